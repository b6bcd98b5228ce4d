"""The openai SDK's cases: chat completions (tools, streamed calls, `parse`, json_schema) and
the Responses API (`responses.stream`, `parse`, tool loops)."""

from __future__ import annotations

import json
from typing import Any

from loadtest.framework_cases.common import (
    CHAT_TOOLS,
    MAX_TOKENS,
    MEETING,
    PERSON,
    PERSON_SCHEMA,
    RESPONSES_TOOLS,
    SAMPLING,
    TIME,
    WEATHER,
    CaseContext,
    Meeting,
    Person,
    WeatherArgs,
    check_call,
    expect,
    user,
)

# --- openai SDK: chat completions -------------------------------------------------------------


def _chat_calls(message: Any, forced: str | None = None, exactly: int | None = None) -> str:
    calls = message.tool_calls or []
    expect(calls, f"no tool calls; content={str(message.content)[:80]!r}")
    expect(exactly is None or len(calls) == exactly, f"{len(calls)} tool calls, want {exactly}")
    for call in calls:
        expect(call.id and call.type == "function", f"tool call id={call.id!r} type={call.type!r}")
    return "; ".join(check_call(c.function.name, c.function.arguments, forced) for c in calls)


def _chat(ctx: CaseContext, prompt: str, **fields: Any) -> Any:
    return ctx.openai().chat.completions.create(
        model=ctx.model, messages=user(prompt), **SAMPLING, **fields
    )


def _chat_tools(ctx: CaseContext, choice: Any, prompt: str = WEATHER, **fields: Any) -> Any:
    return _chat(ctx, prompt, tools=CHAT_TOOLS, tool_choice=choice, **fields).choices[0]


def _answer_or_calls(message: Any) -> str:
    if message.tool_calls:
        return _chat_calls(message)
    expect(isinstance(message.content, str) and message.content, "neither content nor calls")
    return f"content {len(message.content)} chars"


def sdk_chat_plain(ctx: CaseContext) -> str:
    choice = _chat(ctx, "Say hello in one sentence.").choices[0]
    expect(isinstance(choice.message.content, str) and choice.message.content, "empty content")
    return f"finish={choice.finish_reason}"


def sdk_chat_tools_auto(ctx: CaseContext) -> str:
    return _answer_or_calls(_chat_tools(ctx, "auto").message)


def sdk_chat_tools_required(ctx: CaseContext) -> str:
    choice = _chat_tools(ctx, "required")
    return f"finish={choice.finish_reason} {_chat_calls(choice.message)}"


def sdk_chat_tools_named(ctx: CaseContext) -> str:
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _chat_tools(ctx, named, TIME)
    return f"finish={choice.finish_reason} {_chat_calls(choice.message, forced='get_time')}"


def sdk_chat_tools_required_single(ctx: CaseContext) -> str:
    choice = _chat_tools(ctx, "required", parallel_tool_calls=False)
    return _chat_calls(choice.message, exactly=1)


def sdk_chat_tools_none(ctx: CaseContext) -> str:
    message = _chat_tools(ctx, "none").message
    expect(not message.tool_calls, "tool calls despite tool_choice none")
    expect(isinstance(message.content, str) and message.content, "empty content")
    return f"content {len(message.content)} chars"


def _stream_chat(ctx: CaseContext, prompt: str, **fields: Any) -> tuple[str, list[dict], str]:
    """Accumulates a streamed choice as the SDK does: content and each call's fields (by index)
    concatenated."""
    content, calls, finish = "", {}, ""
    stream = _chat(ctx, prompt, stream=True, **fields)
    for chunk in stream:
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
                call["id"] += delta.id or ""
                call["name"] += (delta.function and delta.function.name) or ""
                call["arguments"] += (delta.function and delta.function.arguments) or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def _streamed_calls(calls: list[dict], forced: str | None = None) -> str:
    expect(calls, "no tool call deltas")
    expect(all(c["id"] for c in calls), "a streamed tool call without an id")
    return "; ".join(check_call(c["name"], c["arguments"], forced) for c in calls)


def sdk_chat_stream_plain(ctx: CaseContext) -> str:
    content, _, finish = _stream_chat(ctx, "Say hello in one sentence.")
    expect(content and finish, f"content {len(content)} chars, finish_reason {finish!r}")
    return f"finish={finish}"


def sdk_chat_stream_tools_required(ctx: CaseContext) -> str:
    _, calls, finish = _stream_chat(ctx, WEATHER, tools=CHAT_TOOLS, tool_choice="required")
    return f"finish={finish} {_streamed_calls(calls)}"


def sdk_chat_stream_tools_named(ctx: CaseContext) -> str:
    named = {"type": "function", "function": {"name": "get_time"}}
    _, calls, finish = _stream_chat(ctx, TIME, tools=CHAT_TOOLS, tool_choice=named)
    return f"finish={finish} {_streamed_calls(calls, 'get_time')}"


def sdk_chat_json_schema_strict(ctx: CaseContext) -> str:
    schema = {"name": "person", "schema": PERSON_SCHEMA, "strict": True}
    choice = _chat(ctx, PERSON, response_format={"type": "json_schema", "json_schema": schema})
    return repr(Person.model_validate_json(choice.choices[0].message.content or ""))


def sdk_chat_json_object(ctx: CaseContext) -> str:
    choice = _chat(ctx, PERSON, response_format={"type": "json_object"}).choices[0]
    value = json.loads(choice.message.content or "")
    expect(isinstance(value, dict), f"JSON {type(value).__name__}, not an object")
    return f"keys {sorted(value)}"


def sdk_chat_parse(ctx: CaseContext) -> str:
    client = ctx.openai()
    completion = client.chat.completions.parse(
        model=ctx.model, messages=user(PERSON), response_format=Person, **SAMPLING
    )
    parsed = completion.choices[0].message.parsed
    expect(isinstance(parsed, Person), f"parsed {parsed!r}")
    return repr(parsed)


def _parse_forced_tool(ctx: CaseContext, arguments: type, name: str, prompt: str) -> str:
    """chat.completions.parse with a pydantic_function_tool, required: its parsed arguments."""
    import openai

    tool = openai.pydantic_function_tool(arguments, name=name)
    completion = ctx.openai().chat.completions.parse(
        model=ctx.model, messages=user(prompt), tools=[tool], tool_choice="required", **SAMPLING
    )
    calls = completion.choices[0].message.tool_calls or []
    expect(calls, "no tool calls")
    parsed = calls[0].function.parsed_arguments
    expect(isinstance(parsed, arguments), f"parsed_arguments {parsed!r}")
    return repr(parsed)[:120]


def sdk_chat_parse_tools(ctx: CaseContext) -> str:
    return _parse_forced_tool(ctx, WeatherArgs, "get_weather", WEATHER)


def sdk_chat_parse_nested(ctx: CaseContext) -> str:
    completion = ctx.openai().chat.completions.parse(
        model=ctx.model, messages=user(MEETING), response_format=Meeting, **SAMPLING
    )
    parsed = completion.choices[0].message.parsed
    expect(isinstance(parsed, Meeting), f"parsed {parsed!r}")
    return repr(parsed)[:120]


def sdk_chat_parse_tools_nested(ctx: CaseContext) -> str:
    return _parse_forced_tool(ctx, Meeting, "book_meeting", MEETING)


def sdk_chat_stream_parse(ctx: CaseContext) -> str:
    client = ctx.openai()
    with client.chat.completions.stream(
        model=ctx.model, messages=user(PERSON), response_format=Person, **SAMPLING
    ) as stream:
        for _ in stream:
            pass
        parsed = stream.get_final_completion().choices[0].message.parsed
    expect(isinstance(parsed, Person), f"parsed {parsed!r}")
    return repr(parsed)


def sdk_chat_tool_loop(ctx: CaseContext) -> str:
    """call (forced) -> the tool's result as a `tool` message -> the next answer (auto)."""
    client, messages = ctx.openai(), user(WEATHER)
    first = client.chat.completions.create(
        model=ctx.model, messages=messages, tools=CHAT_TOOLS, tool_choice="required", **SAMPLING
    )
    message = first.choices[0].message
    detail = _chat_calls(message)
    messages.append(message.model_dump(exclude_none=True))
    for call in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"})
    final = client.chat.completions.create(
        model=ctx.model, messages=messages, tools=CHAT_TOOLS, tool_choice="auto", **SAMPLING
    )
    return f"{detail} -> {_answer_or_calls(final.choices[0].message)}"


# --- openai SDK: Responses API ----------------------------------------------------------------

RESPONSES_SAMPLING: dict[str, Any] = {"temperature": 0, "max_output_tokens": MAX_TOKENS}


def _respond(ctx: CaseContext, input: Any, **fields: Any) -> Any:
    return ctx.openai().responses.create(
        model=ctx.model, input=input, **RESPONSES_SAMPLING, **fields
    )


def _function_calls(response: Any, forced: str | None = None) -> str:
    calls = [item for item in response.output if item.type == "function_call"]
    expect(calls, f"no function_call items; output_text={response.output_text[:80]!r}")
    expect(all(c.call_id for c in calls), "a function_call without a call_id")
    return "; ".join(check_call(c.name, c.arguments, forced) for c in calls)


def _text_or_calls(response: Any) -> str:
    if any(item.type == "function_call" for item in response.output):
        return _function_calls(response)
    expect(response.output_text, f"no text and no calls (status {response.status})")
    return f"status={response.status} text {len(response.output_text)} chars"


def sdk_responses_plain(ctx: CaseContext) -> str:
    return _text_or_calls(_respond(ctx, "Say hello in one sentence."))


def sdk_responses_tools_required(ctx: CaseContext) -> str:
    response = _respond(ctx, WEATHER, tools=RESPONSES_TOOLS, tool_choice="required")
    return _function_calls(response)


def sdk_responses_tools_named(ctx: CaseContext) -> str:
    named = {"type": "function", "name": "get_time"}
    response = _respond(ctx, TIME, tools=RESPONSES_TOOLS, tool_choice=named)
    return _function_calls(response, "get_time")


def sdk_responses_json_schema(ctx: CaseContext) -> str:
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON_SCHEMA,
                       "strict": True}}  # fmt: skip
    return repr(Person.model_validate_json(_respond(ctx, PERSON, text=text).output_text))


def sdk_responses_parse(ctx: CaseContext) -> str:
    response = ctx.openai().responses.parse(
        model=ctx.model, input=PERSON, text_format=Person, **RESPONSES_SAMPLING
    )
    expect(isinstance(response.output_parsed, Person), f"output_parsed {response.output_parsed!r}")
    return repr(response.output_parsed)


def sdk_responses_parse_nested(ctx: CaseContext) -> str:
    response = ctx.openai().responses.parse(
        model=ctx.model, input=MEETING, text_format=Meeting, **RESPONSES_SAMPLING
    )
    parsed = response.output_parsed
    expect(isinstance(parsed, Meeting), f"output_parsed {parsed!r}")
    return repr(parsed)[:120]


def _stream_response(ctx: CaseContext, input: str, **fields: Any) -> tuple[set[str], Any]:
    client = ctx.openai()
    with client.responses.stream(
        model=ctx.model, input=input, **RESPONSES_SAMPLING, **fields
    ) as stream:
        kinds = {event.type for event in stream}
        final = stream.get_final_response()
    ended = {"response.completed", "response.incomplete"} & kinds
    expect(ended and "response.created" in kinds, f"events {sorted(kinds)}")
    return kinds, final


def sdk_responses_stream_text(ctx: CaseContext) -> str:
    kinds, final = _stream_response(ctx, "Say hello in one sentence.")
    expect("response.output_text.delta" in kinds, f"no text deltas: {sorted(kinds)}")
    return _text_or_calls(final)


def sdk_responses_stream_tool(ctx: CaseContext) -> str:
    kinds, final = _stream_response(ctx, WEATHER, tools=RESPONSES_TOOLS, tool_choice="required")
    wanted = "response.function_call_arguments.delta"
    expect(wanted in kinds, f"no {wanted}: {sorted(kinds)}")
    return _function_calls(final)


def sdk_responses_stream_parse(ctx: CaseContext) -> str:
    _, final = _stream_response(ctx, PERSON, text_format=Person)
    expect(isinstance(final.output_parsed, Person), f"output_parsed {final.output_parsed!r}")
    return repr(final.output_parsed)


def sdk_responses_tool_loop(ctx: CaseContext) -> str:
    """call (forced) -> the output items plus a function_call_output -> the next answer."""
    input: list[Any] = [{"role": "user", "content": WEATHER}]
    first = _respond(ctx, input, tools=RESPONSES_TOOLS, tool_choice="required")
    detail = _function_calls(first)
    input += first.output
    for item in first.output:
        if item.type == "function_call":
            input.append(
                {"type": "function_call_output", "call_id": item.call_id, "output": "Sunny, 21 C"}
            )
    final = _respond(ctx, input, tools=RESPONSES_TOOLS, tool_choice="auto")
    return f"{detail} -> {_text_or_calls(final)}"
