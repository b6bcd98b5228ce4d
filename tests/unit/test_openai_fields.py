"""docs/api.md's field table is what the code does: every OpenAI field is honoured (a field of
our request model), refused (server/openai/fields.py) or ignored, and in exactly one state."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from server.http.errors import OpenAIError
from server.openai.fields import (
    CHAT_HONOURED,
    CHAT_REFUSED,
    COMPLETIONS_HONOURED,
    COMPLETIONS_REFUSED,
    IGNORED,
    RESPONSES_HONOURED,
    RESPONSES_IGNORED,
    RESPONSES_REFUSED,
)
from server.openai.protocol import ChatCompletionRequest, CompletionRequest
from server.openai.protocol.responses import ResponsesRequest

API_DOC = Path(__file__).resolve().parents[2] / "docs" / "api.md"


def _table(heading: str) -> dict[str, str]:
    """field -> state from the markdown table under `heading`."""
    text = API_DOC.read_text()
    section = text.split(heading, 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `([a-z_]+)` \| (honoured|refused|ignored) \|", section, re.MULTILINE)
    return dict(rows)


@pytest.mark.parametrize(
    ("heading", "model", "honoured", "refused"),
    [
        ("## `POST /v1/chat/completions`", ChatCompletionRequest, CHAT_HONOURED, CHAT_REFUSED),
        ("## `POST /v1/completions`", CompletionRequest, COMPLETIONS_HONOURED, COMPLETIONS_REFUSED),
    ],
)
def test_the_documented_table_is_the_code(heading, model, honoured, refused):
    table = _table(heading)
    assert {f for f, state in table.items() if state == "honoured"} == honoured
    assert {f for f, state in table.items() if state == "refused"} == set(refused)
    documented_ignored = {f for f, state in table.items() if state == "ignored"}
    assert documented_ignored <= IGNORED
    # Honoured fields are fields of the request model; refused and ignored ones are not.
    assert honoured <= set(model.model_fields)
    assert not (set(refused) | IGNORED) & set(model.model_fields)


def test_the_documented_responses_table_is_the_code():
    table = _table("## `POST /v1/responses`")
    assert {f for f, state in table.items() if state == "honoured"} == RESPONSES_HONOURED
    assert {f for f, state in table.items() if state == "refused"} == set(RESPONSES_REFUSED)
    assert {f for f, state in table.items() if state == "ignored"} == RESPONSES_IGNORED
    assert RESPONSES_HONOURED <= set(ResponsesRequest.model_fields)
    assert not (set(RESPONSES_REFUSED) | RESPONSES_IGNORED) & set(ResponsesRequest.model_fields)


def test_every_field_of_the_sdks_responses_request_is_in_the_table():
    """The installed `openai` package's request type is OpenAI's list of fields."""
    from openai.types.responses.response_create_params import ResponseCreateParamsStreaming

    sdk_fields = set(ResponseCreateParamsStreaming.__annotations__)
    assert sdk_fields - set(_table("## `POST /v1/responses`")) == set()


def _chat(**fields) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}]} | fields
    return ChatCompletionRequest.model_validate(body)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("functions", [{"name": "f"}]),
        ("prediction", {"type": "content", "content": "x"}),
        ("function_call", {"name": "f"}),
        ("reasoning_effort", "low"),
        ("modalities", ["text", "audio"]),
    ],
)
def test_a_refused_field_with_a_real_value_is_a_400_naming_it(field, value):
    with pytest.raises(OpenAIError) as raised:
        _chat(**{field: value}).check_fields()
    assert raised.value.status == 400 and raised.value.param == field
    assert raised.value.code == "unsupported_parameter"


@pytest.mark.parametrize(
    "fields",
    [
        {"functions": []},
        {"function_call": "none"},
        {"response_format": {"type": "text"}},
        {"modalities": ["text"]},
        {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto"},
        {"some_other_servers_extension": 3},
    ],
)
def test_no_op_values_ignored_fields_and_unknown_fields_are_accepted(fields):
    _chat(**fields).check_fields()


def test_a_tool_call_history_is_kept_and_a_message_function_call_refused():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
    ]
    request = ChatCompletionRequest.model_validate({"messages": messages})
    request.check_fields()
    assert request.messages[1].tool_calls[0].function.name == "f"
    assert request.messages[2].tool_call_id == "c1"
    messages[1] = {"role": "assistant", "content": None, "function_call": {"name": "f"}}
    with pytest.raises(OpenAIError) as raised:
        ChatCompletionRequest.model_validate({"messages": messages}).check_fields()
    assert raised.value.param == "messages" and "messages[1]" in raised.value.message


def test_completions_refuse_best_of_and_suffix():
    for field, value in (("best_of", 3), ("suffix", "!")):
        request = CompletionRequest.model_validate({"prompt": "x", field: value})
        with pytest.raises(OpenAIError) as raised:
            request.check_fields()
        assert raised.value.param == field
    CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": ""}).check_fields()


@pytest.mark.parametrize(
    ("field", "value"),
    [("guided_json", {"type": "object"}), ("guided_regex", "a+"), ("structured_outputs", {})],
)
def test_responses_refuse_the_structured_output_extensions_of_chat(field, value):
    request = ResponsesRequest.model_validate({"input": "x", field: value})
    with pytest.raises(OpenAIError) as raised:
        request.check_fields()
    assert raised.value.status == 400 and raised.value.param == field
    ResponsesRequest.model_validate({"input": "x", "guided_json": None}).check_fields()
