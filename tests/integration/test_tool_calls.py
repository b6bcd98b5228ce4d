"""Tool calling over real HTTP with the official `openai` client and the real model: named and
required choices always give calls whose arguments validate against their schemas (the
`jsonschema` package), streamed as OpenAI's deltas or not; auto gives content or calls in
OpenAI's shape; none gives text; a tool-call history reaches the prompt; bad tool fields are
400s naming them. SmolLM2-135M takes the hermes prompt path (its template has no tools)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from openai import AsyncOpenAI, BadRequestError
from tool_fixtures import DESCRIPTIONS, QUESTION, SCHEMAS, assert_valid_call

MODEL = "SmolLM2-135M-Instruct"
MAX_TOKENS = 96

# Chat's nested function tools.
TOOLS = [
    {"type": "function", "function": {"name": name, "description": DESCRIPTIONS[name],
                                      "parameters": schema}}
    for name, schema in SCHEMAS.items()
]  # fmt: skip
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _request(**fields) -> dict:
    """The question with both tools, and these fields on top."""
    return {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": MAX_TOKENS} | fields


async def _chat(client: AsyncOpenAI, **fields):
    fields = _request(**fields)
    return (await client.chat.completions.create(**fields)).choices[0]


async def _streamed(client: AsyncOpenAI, **fields) -> tuple[str, dict[int, dict], list[str]]:
    """(content, {index: {"id", "name", "arguments"}}, finish reasons) of a streamed chat."""
    fields = _request(**fields)
    stream = await client.chat.completions.create(stream=True, **fields)
    content, calls, finishes = [], {}, []
    async for chunk in stream:
        for choice in chunk.choices:
            content.append(choice.delta.content or "")
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": None, "name": None, "arguments": ""})
                if delta.id is not None:  # the header: id, type and name come once, first
                    assert call["id"] is None and delta.type == "function"
                    call["id"], call["name"] = delta.id, delta.function.name
                assert call["id"] is not None
                call["arguments"] += delta.function.arguments or ""
            if choice.finish_reason is not None:
                finishes.append(choice.finish_reason)
    return "".join(content), calls, finishes


async def test_a_named_tool_choice_always_gives_that_call(openai_client: AsyncOpenAI):
    plain, sampled, (content, calls, finishes) = await asyncio.gather(
        _chat(openai_client, tool_choice=NAMED, temperature=0.0),
        _chat(openai_client, tool_choice=NAMED, temperature=1.0, seed=5),
        _streamed(openai_client, tool_choice=NAMED, temperature=0.0),
    )
    for choice in (plain, sampled):
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        [call] = choice.message.tool_calls
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name == "get_weather"
        assert_valid_call(call.function.name, call.function.arguments)
    assert finishes == ["tool_calls"] and content == ""
    [call] = calls.values()
    assert list(calls) == [0] and call["name"] == "get_weather" and call["id"].startswith("call_")
    assert_valid_call(call["name"], call["arguments"])


async def test_required_calls_listed_tools_with_valid_arguments(openai_client: AsyncOpenAI):
    choices = await asyncio.gather(
        _chat(openai_client, tool_choice="required", temperature=0.0),
        _chat(openai_client, tool_choice="required", temperature=1.0, seed=1),
        _chat(openai_client, tool_choice="required", temperature=1.0, seed=2),
        _chat(openai_client, tool_choice="required", parallel_tool_calls=False, temperature=0.0),
    )
    for choice in choices:
        # The turn ends after a complete call: no repeats until max_tokens.
        assert choice.finish_reason == "tool_calls", choice.message.tool_calls
        assert choice.message.tool_calls and choice.message.content is None
        for call in choice.message.tool_calls:
            assert_valid_call(call.function.name, call.function.arguments)
    greedy, single = choices[0], choices[-1]
    assert len(greedy.message.tool_calls) == 1  # it used to call add twice, then stop
    assert len(single.message.tool_calls) == 1
    for parallel in (None, False):
        fields = {} if parallel is None else {"parallel_tool_calls": parallel}
        content, calls, finishes = await _streamed(
            openai_client, tool_choice="required", temperature=0.0, **fields
        )
        assert finishes == ["tool_calls"] and content == "" and list(calls) == [0]
        assert_valid_call(calls[0]["name"], calls[0]["arguments"])


async def test_a_forced_call_wins_over_a_response_format(openai_client: AsyncOpenAI):
    """What an agent with an output type and a forced tool sends (openai-agents): the turn is
    the call; the format is for the turn that answers in text."""
    person = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    response_format = {"type": "json_schema", "json_schema": {"name": "p", "schema": person}}
    for tool_choice in ("required", NAMED):
        choice = await _chat(
            openai_client, tool_choice=tool_choice, temperature=0.0, response_format=response_format
        )
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        for call in choice.message.tool_calls:
            assert_valid_call(call.function.name, call.function.arguments)


async def test_a_required_call_ends_well_within_a_small_max_tokens(openai_client: AsyncOpenAI):
    """One call is ~36 tokens: with max_tokens 48 a repeated call was cut (`length`)."""
    choice = await _chat(openai_client, tool_choice="required", temperature=0.0, max_tokens=48)
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1


async def _tool_call_finishes(http: httpx.AsyncClient) -> float:
    text = (await http.get("/metrics")).text
    line = next(line for line in text.splitlines() if line.startswith(
        "meterserve_requests_total{") and 'finished_reason="tool_calls"' in line)  # fmt: skip
    return float(line.rsplit(" ", 1)[1])


async def test_tool_call_finishes_are_counted_as_the_client_got_them(
    openai_client: AsyncOpenAI, http: httpx.AsyncClient
):
    before = await _tool_call_finishes(http)
    choice = await _chat(openai_client, tool_choice="required", temperature=0.0)
    _, _, finishes = await _streamed(openai_client, tool_choice="required", temperature=0.0)
    assert [choice.finish_reason, *finishes] == ["tool_calls", "tool_calls"]
    for _ in range(100):  # a request is booked when its last final event has arrived
        if await _tool_call_finishes(http) == before + 2:
            break
        await asyncio.sleep(0.1)
    assert await _tool_call_finishes(http) == before + 2


async def test_auto_answers_in_text_or_calls_and_none_in_text(openai_client: AsyncOpenAI):
    auto, sampled, none, (content, calls, finishes) = await asyncio.gather(
        _chat(openai_client, temperature=0.0),  # tool_choice defaults to auto with tools
        _chat(openai_client, tool_choice="auto", temperature=1.0, seed=3),
        _chat(openai_client, tool_choice="none", temperature=0.0),
        _streamed(openai_client, tool_choice="auto", temperature=0.0),
    )
    for choice in (auto, sampled):
        if choice.message.tool_calls:  # the model chose to call: parsed, named from the list
            assert choice.finish_reason in ("tool_calls", "length")
            for call in choice.message.tool_calls:
                assert call.id.startswith("call_") and isinstance(call.function.arguments, str)
                json.loads(call.function.arguments)
        else:
            assert isinstance(choice.message.content, str)
            assert choice.finish_reason in ("stop", "length")
    assert none.message.tool_calls is None and isinstance(none.message.content, str)
    assert none.finish_reason in ("stop", "length")
    assert len(finishes) == 1 and (content or calls)


HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": '{"city": "Paris", "unit": "celsius"}',
                },
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 degrees"},
]


async def test_a_tool_call_history_reaches_the_prompt(
    openai_client: AsyncOpenAI, http: httpx.AsyncClient
):
    tokens = (await http.post("/tokenize", json={"messages": HISTORY})).json()["tokens"]
    text = (await http.post("/detokenize", json={"tokens": tokens})).json()["prompt"]
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
        "\n</tool_call>" in text
    )
    assert "<tool_response>\nSunny, 21 degrees\n</tool_response>" in text
    response = await openai_client.chat.completions.create(
        model=MODEL, messages=HISTORY, tools=TOOLS, max_tokens=16, temperature=0.0
    )
    # The same history, plus the tools section in the system prompt.
    assert response.usage.prompt_tokens > len(tokens)
    assert response.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        (
            {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "nope",
        ),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "only allowed when tools"),
        ({"tools": [{"type": "custom", "custom": {"name": "x"}}]}, "tools", "only function tools"),
        ({"tools": [TOOLS[0], TOOLS[0]]}, "tools", "more than one function"),
        ({"functions": [{"name": "f"}]}, "functions", "not supported"),
    ],
)
async def test_bad_tool_fields_are_a_400_naming_them(
    openai_client: AsyncOpenAI, fields, param, words
):
    request = {"model": MODEL, "messages": QUESTION, "tools": TOOLS, "max_tokens": 4} | fields
    request = {key: value for key, value in request.items() if value is not None}
    with pytest.raises(BadRequestError) as raised:
        await openai_client.chat.completions.create(**request)
    assert raised.value.body["param"] == param and words in raised.value.body["message"]
