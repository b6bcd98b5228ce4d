"""The Responses API (`POST /v1/responses`) through the official `openai` client over real
HTTP on the real model: text and message input, instructions, max_output_tokens, the typed
stream, json_schema output, function tools (named, required and streamed calls validate
against their schemas; a call history reaches the prompt), the stateless refusal, and the
meter's usage extension.

Greedy comparisons warm the prefix cache first (as tests/integration/test_openai_api.py does),
so the requests compared are computed identically."""

from __future__ import annotations

import json
import uuid

import httpx
import jsonschema
import pytest
from openai import APIError, AsyncOpenAI, BadRequestError, NotFoundError
from serverproc import FAULT_TOKEN_ID, assert_no_leaked_blocks, metric_value, wait_idle
from tool_fixtures import DESCRIPTIONS, QUESTION, SCHEMAS, assert_valid_call

MODEL = "SmolLM2-135M-Instruct"
FAULT_TOKEN_TEXT = "<jupyter_code>"  # FAULT_TOKEN_ID's text
# The Responses API's flat function tools.
TOOLS = [
    {"type": "function", "name": name, "description": DESCRIPTIONS[name], "parameters": schema}
    for name, schema in SCHEMAS.items()
]
EVENT_ORDER_HEAD = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
EVENT_ORDER_TAIL = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
]


async def _stream(client: AsyncOpenAI, **kwargs) -> list:
    stream = await client.responses.create(stream=True, **kwargs)
    return [event async for event in stream]


def _check_usage(usage) -> None:
    assert usage.input_tokens > 0 and usage.output_tokens > 0
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    cached = usage.input_tokens_details.cached_tokens
    # Whole 16-token blocks, never the last input token (test_cached_tokens_are_exact).
    assert cached % 16 == 0 and cached < usage.input_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0
    assert usage.model_extra["cost_usd"] > 0  # meterserve's meter, as on chat


async def test_cached_tokens_are_exact(openai_client: AsyncOpenAI):
    """A fresh conversation caches nothing; its repeat hits every whole block of it."""
    unique = f"Session {uuid.uuid4().hex}: answer in one short sentence."
    kwargs = {"model": MODEL, "instructions": unique, "input": "Say hi.", "temperature": 0}
    first = await openai_client.responses.create(max_output_tokens=4, **kwargs)
    again = await openai_client.responses.create(max_output_tokens=4, **kwargs)
    assert first.usage.input_tokens_details.cached_tokens == 0
    num_input = again.usage.input_tokens
    assert num_input == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens == (num_input - 1) // 16 * 16


async def test_string_input(openai_client: AsyncOpenAI):
    response = await openai_client.responses.create(
        model=MODEL, input="Name three colors.", max_output_tokens=24, temperature=0
    )
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status in ("completed", "incomplete") and response.output_text
    [message] = response.output
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "output_text"
    assert message.content[0].text == response.output_text
    assert response.store is False and response.model == MODEL
    _check_usage(response.usage)


async def test_messages_with_instructions_reach_the_template(
    http: httpx.AsyncClient, openai_client: AsyncOpenAI
):
    items = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello Ada."}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
    ]
    instructions = "Answer in one short sentence."
    response = await openai_client.responses.create(
        model=MODEL, input=items, instructions=instructions, max_output_tokens=16
    )
    assert response.output_text and response.instructions == instructions
    # The prompt is exactly the chat template's rendering of the same conversation.
    messages = [
        {"role": "system", "content": instructions},
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": "Hello Ada."},
        {"role": "user", "content": "Hi"},
    ]
    counted = await http.post("/tokenize", json={"messages": messages})
    assert response.usage.input_tokens == counted.json()["count"]


async def test_max_output_tokens_makes_it_incomplete(openai_client: AsyncOpenAI):
    response = await openai_client.responses.create(
        model=MODEL, input="Write a long story about the sea.", max_output_tokens=5
    )
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"
    assert response.usage.output_tokens == 5


async def test_stream_events_in_order_and_equal_to_the_response(openai_client: AsyncOpenAI):
    args = {"model": MODEL, "input": "Name three colors.", "max_output_tokens": 20}
    await openai_client.responses.create(**(args | {"max_output_tokens": 1}))  # warm the cache
    whole = await openai_client.responses.create(**args, temperature=0)
    events = await _stream(openai_client, **args, temperature=0)
    types = [event.type for event in events]
    assert types[:4] == EVENT_ORDER_HEAD
    assert types[-4:-1] == EVENT_ORDER_TAIL
    assert types[-1] == f"response.{whole.status}"
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert deltas and types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in deltas)
    assert text == events[-4].text == whole.output_text  # greedy: stream equals non-stream
    item_id = events[2].item.id
    assert all(e.item_id == item_id and e.output_index == 0 for e in deltas)
    final = events[-1].response
    assert final.output_text == text and final.output[0].id == item_id
    assert events[0].response.status == "in_progress" and events[0].response.usage is None
    # The streamed usage has the non-streamed shape and counts.
    _check_usage(final.usage)
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert set(final.usage.model_extra) == set(whole.usage.model_extra)


async def test_the_stream_ends_without_done(http: httpx.AsyncClient):
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True}
    async with http.stream("POST", "/v1/responses", json=body) as response:
        raw = (await response.aread()).decode()
    blocks = [block for block in raw.split("\n\n") if block.strip()]
    assert "[DONE]" not in raw
    for block in blocks:  # every event names its type on both lines
        event_line, data_line = block.split("\n")
        assert event_line.removeprefix("event: ") == json.loads(data_line[len("data: ") :])["type"]


async def test_json_schema_output_validates(openai_client: AsyncOpenAI):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "population": {"type": "integer", "minimum": 0, "maximum": 10**10},
        },
        "required": ["city", "population"],
        "additionalProperties": False,
    }
    fmt = {"type": "json_schema", "name": "city", "schema": schema, "strict": True}
    for temperature in (0, 1.0):
        response = await openai_client.responses.create(
            model=MODEL,
            input="Give a city and its population as JSON.",
            text={"format": fmt},
            # The grammar bounds the answer (20 characters, 11 digits), so a sampled one ends
            # well inside the limit too (an unbounded integer once ran past it).
            max_output_tokens=256,
            temperature=temperature,
        )
        assert response.status == "completed"
        jsonschema.validate(json.loads(response.output_text), schema)
        assert response.text.format.type == "json_schema"
    events = await _stream(
        openai_client,
        model=MODEL,
        input="Give a city and its population as JSON.",
        text={"format": fmt},
        max_output_tokens=256,
    )
    jsonschema.validate(json.loads(events[-1].response.output_text), schema)


async def test_json_object_output_is_an_object(openai_client: AsyncOpenAI):
    response = await openai_client.responses.create(
        model=MODEL,
        input="Describe a cat as a JSON object.",
        text={"format": {"type": "json_object"}},
        max_output_tokens=48,
        temperature=0,
    )
    if response.status == "completed":
        assert isinstance(json.loads(response.output_text), dict)
    else:  # the limit cut it: an object still being written
        assert response.output_text.startswith("{")


async def test_previous_response_id_is_refused(openai_client: AsyncOpenAI):
    with pytest.raises(BadRequestError) as raised:
        await openai_client.responses.create(
            model=MODEL, input="And then?", previous_response_id="resp_123"
        )
    error = raised.value.body
    assert error["param"] == "previous_response_id" and "stateless" in error["message"]


async def test_a_named_tool_choice_gives_a_valid_function_call(openai_client: AsyncOpenAI):
    response = await openai_client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=96,
    )
    assert response.status == "completed"
    calls = [item for item in response.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather"
    assert calls[0].call_id.startswith("call_") and calls[0].id.startswith("fc_")
    assert_valid_call(calls[0].name, calls[0].arguments)
    assert response.tool_choice.name == "get_weather"
    assert [tool.name for tool in response.tools] == ["get_weather", "add"]


async def test_required_tool_calls_stream_as_function_call_items(openai_client: AsyncOpenAI):
    events = await _stream(
        openai_client,
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_output_tokens=160,
        temperature=0,
    )
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert events[-1].type == "response.completed"
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and final.output == calls  # one call, then the turn ended
    for call in calls:
        assert_valid_call(call.name, call.arguments)
        index = final.output.index(call)
        mine = [e for e in events if getattr(e, "output_index", None) == index]
        assert [e.type for e in mine] == [
            "response.output_item.added",
            "response.function_call_arguments.delta",
            "response.function_call_arguments.done",
            "response.output_item.done",
        ]
        assert mine[0].item.arguments == "" and mine[1].delta == mine[2].arguments
        assert mine[2].arguments == call.arguments and mine[3].item.call_id == call.call_id


@pytest.mark.parametrize("parallel", [True, False])
async def test_a_required_call_completes_the_response(openai_client: AsyncOpenAI, parallel):
    """The turn ends after the call: `completed`, not `incomplete` at max_output_tokens (the
    openai-agents SDK raises on an incomplete response)."""
    response = await openai_client.responses.create(
        model=MODEL,
        input=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_output_tokens=64,
        temperature=0,
    )
    assert response.status == "completed" and response.incomplete_details is None
    [call] = response.output
    assert call.type == "function_call"
    assert_valid_call(call.name, call.arguments)


async def test_tool_choice_none_gives_text(openai_client: AsyncOpenAI):
    response = await openai_client.responses.create(
        model=MODEL, input=QUESTION, tools=TOOLS, tool_choice="none", max_output_tokens=24
    )
    assert [item.type for item in response.output] == ["message"]
    assert response.output_text


async def test_a_tool_call_history_reaches_the_prompt(
    http: httpx.AsyncClient, openai_client: AsyncOpenAI
):
    arguments = '{"city": "Paris", "unit": "celsius"}'
    items = [
        *QUESTION,
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": arguments},
        {"type": "function_call_output", "call_id": "call_1", "output": "22 degrees, sunny"},
    ]  # fmt: skip
    response = await openai_client.responses.create(model=MODEL, input=items, max_output_tokens=16)
    assert response.output_text
    # The same conversation in chat's shape renders to the same prompt.
    messages = [
        *QUESTION,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": arguments}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees, sunny"},
    ]  # fmt: skip
    counted = (await http.post("/tokenize", json={"messages": messages})).json()["count"]
    plain = (await http.post("/tokenize", json={"messages": QUESTION})).json()["count"]
    assert response.usage.input_tokens == counted > plain


async def test_hosted_tools_are_refused_naming_them(openai_client: AsyncOpenAI):
    with pytest.raises(BadRequestError) as raised:
        await openai_client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert raised.value.body["param"] == "tools"


async def test_errors_name_the_responses_parameters(openai_client: AsyncOpenAI):
    with pytest.raises(BadRequestError) as raised:
        await openai_client.responses.create(model=MODEL, input="x", max_output_tokens=10**7)
    assert raised.value.body["param"] == "max_output_tokens"
    assert "max_output_tokens" in raised.value.body["message"]
    bad_schema = {"type": "object", "properties": 3}
    fmt = {"type": "json_schema", "name": "x", "schema": bad_schema}
    with pytest.raises(BadRequestError) as raised:
        await openai_client.responses.create(model=MODEL, input="x", text={"format": fmt})
    assert raised.value.body["param"] == "text"
    assert raised.value.body["message"].startswith("invalid text.format: ")
    assert "properties must be an object" in raised.value.body["message"]


async def test_unknown_model_is_a_404(openai_client: AsyncOpenAI):
    with pytest.raises(NotFoundError) as raised:
        await openai_client.responses.create(model="gpt-17", input="x")
    assert raised.value.body["param"] == "model"


async def test_the_meter_counts_what_usage_says(
    http: httpx.AsyncClient, openai_client: AsyncOpenAI
):
    """The counters book the same bill `usage` reports, streamed or not."""
    names = ("meterserve_prompt_tokens_total", "meterserve_generation_tokens_total")
    await wait_idle(http)
    before = [await metric_value(http, name) for name in names]
    args = {"model": MODEL, "input": "Name a fruit.", "max_output_tokens": 12}
    whole = await openai_client.responses.create(**args)
    streamed = (await _stream(openai_client, **args))[-1].response
    await wait_idle(http)
    after = [await metric_value(http, name) for name in names]
    assert after[0] - before[0] == whole.usage.input_tokens + streamed.usage.input_tokens
    assert after[1] - before[1] == whole.usage.output_tokens + streamed.usage.output_tokens


async def test_a_model_fault_mid_stream_is_an_error_event(
    http: httpx.AsyncClient, openai_client: AsyncOpenAI
):
    """As on chat: after the first event, a failure is one error event, which the SDK raises.
    The fault token's text is a special token, so the chat template's prompt holds its id."""
    body = {"prompt": FAULT_TOKEN_TEXT, "add_special_tokens": False}
    assert (await http.post("/tokenize", json=body)).json()["tokens"] == [FAULT_TOKEN_ID]
    faulty = f"Hello {FAULT_TOKEN_TEXT}"
    with pytest.raises(APIError, match="model step failed"):
        await _stream(openai_client, model=MODEL, input=faulty, max_output_tokens=8)
    response = await http.post("/v1/responses", json={"input": faulty, "max_output_tokens": 8})
    assert response.status_code == 500 and response.json()["error"]["type"] == "server_error"
    assert_no_leaked_blocks(await wait_idle(http))


async def test_a_client_leaving_mid_stream_frees_its_blocks(http: httpx.AsyncClient):
    body = {"model": MODEL, "input": "Count to one hundred.", "stream": True}
    body |= {"max_output_tokens": 400}
    async with http.stream("POST", "/v1/responses", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("event: response.output_text.delta"):
                break  # leave with the request still generating
    assert_no_leaked_blocks(await wait_idle(http))
