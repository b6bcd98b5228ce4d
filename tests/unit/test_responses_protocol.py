"""The Responses API's request as the chat path sees it: input → chat messages, text.format →
response_format, sampling fields; refused and stateful fields are 400s naming them; our
response models parse as the `openai` package's Response."""

from __future__ import annotations

import pytest
from openai.types.responses import Response as SDKResponse
from pydantic import ValidationError

from server.http.errors import OpenAIError
from server.openai.protocol.responses import ResponsesRequest
from server.openai.protocol.responses_output import (
    InputTokensDetails,
    OutputMessage,
    OutputText,
    ResponsesResponse,
    ResponseUsage,
)


def _request(**fields) -> ResponsesRequest:
    request = ResponsesRequest.model_validate({"input": "hi"} | fields)
    request.check_fields()
    return request


def _turns(request: ResponsesRequest) -> list[tuple[str, str]]:
    return [(m.role, m.text()) for m in request.messages()]


def test_a_string_input_is_one_user_message():
    assert _turns(_request(input="Name a color.")) == [("user", "Name a color.")]


def test_instructions_come_first_as_a_system_message():
    request = _request(input="Name a color.", instructions="Answer in one word.")
    assert _turns(request) == [("system", "Answer in one word."), ("user", "Name a color.")]


def test_message_items_keep_their_roles_and_join_their_text_parts():
    items = [
        {"role": "developer", "content": "Be terse."},
        {"type": "message", "role": "user", "content": [
            {"type": "input_text", "text": "Name "}, {"type": "input_text", "text": "a color."}
        ]},
        # An earlier response's output item sent back as it came (id, status, annotations).
        {"type": "message", "id": "msg_1", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "Red.", "annotations": []}]},
        {"role": "user", "content": "Another."},
    ]  # fmt: skip
    request = _request(input=items, instructions="Sys.")
    assert _turns(request) == [
        ("system", "Sys."),
        ("developer", "Be terse."),  # the chat template's path maps developer to system
        ("user", "Name a color."),
        ("assistant", "Red."),
        ("user", "Another."),
    ]


@pytest.mark.parametrize(
    "bad_input",
    [
        [],
        [{"role": "tool", "content": "x"}],
        [{"type": "reasoning", "id": "rs_1", "summary": []}],
        [{"type": "function_call", "call_id": "c", "name": "f"}],  # no arguments
        [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}],
    ],
)
def test_inputs_the_chat_path_cannot_take_are_invalid(bad_input):
    with pytest.raises(ValidationError):
        ResponsesRequest.model_validate({"input": bad_input})


def test_sampling_fields_carry_the_request():
    fields = _request(max_output_tokens=7, temperature=0.0, top_p=0.5, stream=True, top_k=3)
    sampling = fields.sampling_fields()
    assert (sampling.max_tokens, sampling.temperature, sampling.top_p) == (7, 0.0, 0.5)
    assert sampling.stream and sampling.top_k == 3 and sampling.n == 1
    assert sampling.response_format is None and sampling.stop_strings == []


def test_text_formats_become_response_formats():
    assert _request(text={"format": {"type": "text"}}).sampling_fields().response_format is None
    json_object = _request(text={"format": {"type": "json_object"}}).sampling_fields()
    assert json_object.response_format.type == "json_object"
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "name": "thing", "schema": schema, "strict": True}
    converted = _request(text={"format": fmt}).sampling_fields().response_format
    assert converted.type == "json_schema"
    assert converted.json_schema.name == "thing" and converted.json_schema.schema_ == schema
    assert converted.json_schema.strict is True


def test_a_json_schema_format_needs_a_schema():
    with pytest.raises(ValidationError, match="needs `schema`"):
        ResponsesRequest.model_validate({"input": "x", "text": {"format": {"type": "json_schema"}}})


@pytest.mark.parametrize("field", ["previous_response_id", "conversation"])
def test_stateful_fields_are_refused_saying_meterserve_is_stateless(field):
    with pytest.raises(OpenAIError) as raised:
        _request(**{field: "resp_123"})
    assert raised.value.status == 400 and raised.value.param == field
    assert "stateless" in raised.value.message


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tool_calls", 2),
        ("reasoning", {"effort": "high"}),
        ("include", ["message.output_text.logprobs"]),
        ("top_logprobs", 3),
        ("truncation", "auto"),
        ("background", True),
        ("prompt", {"id": "pmpt_1"}),
    ],
)
def test_refused_fields_with_real_values_are_400s_naming_them(field, value):
    with pytest.raises(OpenAIError) as raised:
        _request(**{field: value})
    assert raised.value.param == field and raised.value.code == "unsupported_parameter"


def test_function_calls_and_their_outputs_become_chat_tool_turns():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": "Checking."},
        {"type": "function_call", "call_id": "c1", "name": "weather",
         "arguments": '{"city": "Paris"}', "id": "fc_1", "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "weather",
         "arguments": '{"city": "Rome"}'},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2",
         "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "time", "arguments": "{}"},
    ]  # fmt: skip
    turns = _request(input=items).messages()
    assert [t.role for t in turns] == ["user", "assistant", "tool", "tool", "assistant"]
    # Calls right after an assistant message join it, as one chat assistant turn.
    assert turns[1].text() == "Checking."
    assert [(c.id, c.function.name, c.function.arguments) for c in turns[1].tool_calls] == [
        ("c1", "weather", '{"city": "Paris"}'),
        ("c2", "weather", '{"city": "Rome"}'),
    ]
    assert [(t.tool_call_id, t.text()) for t in turns[2:4]] == [("c1", "sunny"), ("c2", "rain")]
    assert turns[4].content is None and turns[4].tool_calls[0].id == "c3"


def test_function_tools_and_tool_choice_become_the_tool_paths_values():
    tool = {"type": "function", "name": "weather", "description": "d",
            "parameters": {"type": "object", "properties": {}}, "strict": True}  # fmt: skip
    request = _request(tools=[tool], tool_choice={"type": "function", "name": "weather"})
    [function] = request.function_tools()
    assert (function.name, function.description, function.strict) == ("weather", "d", True)
    assert function.parameters == tool["parameters"]
    choice = request.tool_choice_value()
    assert (choice.mode, choice.name) == ("named", "weather")
    assert _request(tools=[tool], tool_choice="required").tool_choice_value().mode == "required"
    assert _request(tools=[tool]).tool_choice_value() is None  # the policy's default: auto


@pytest.mark.parametrize(
    "tools", [[{"type": "web_search"}], [{"type": "function", "parameters": {}}]]
)
def test_tools_other_than_named_functions_are_refused(tools):
    with pytest.raises(OpenAIError) as raised:
        _request(tools=tools)
    assert raised.value.param == "tools"


def test_text_verbosity_is_refused():
    with pytest.raises(OpenAIError) as raised:
        _request(text={"format": {"type": "text"}, "verbosity": "low"})
    assert raised.value.param == "text" and "verbosity" in raised.value.message


def test_no_ops_and_ignored_fields_are_accepted():
    _request(
        tools=[], truncation="disabled", max_tool_calls=None,
        store=True, metadata={"k": "v"}, user="u", stream_options={"include_obfuscation": False},
        previous_response_id=None, background=False, reasoning=None, include=[],
    )  # fmt: skip


def test_our_response_parses_as_the_sdks_response():
    text = OutputText(text="Hello.")
    response = ResponsesResponse(
        id="resp_1",
        created_at=1,
        status="completed",
        model="m",
        output=[OutputMessage(id="msg_1", status="completed", content=[text])],
        temperature=1.0,
        top_p=1.0,
        text={"format": {"type": "text"}},
        usage=ResponseUsage(
            input_tokens=3,
            input_tokens_details=InputTokensDetails(cached_tokens=0),
            output_tokens=2,
            total_tokens=5,
            cost_usd=1e-6,
        ),
    )
    parsed = SDKResponse.model_validate(response.model_dump(mode="json"))
    assert parsed.output_text == "Hello." and parsed.store is False
    assert parsed.usage.input_tokens == 3
    assert parsed.usage.output_tokens_details.reasoning_tokens == 0
    assert parsed.usage.model_extra["cost_usd"] == 1e-6
