"""langchain-openai's cases: `bind_tools`, `with_structured_output`, tool loops."""

from __future__ import annotations

from typing import Any

from loadtest.framework_cases.common import (
    CHAT_TOOLS,
    MAX_TOKENS,
    PERSON,
    TIME,
    WEATHER,
    CaseContext,
    Person,
    check_call,
    expect,
)

# --- langchain-openai ---------------------------------------------------------------------------


def _chat_model(ctx: CaseContext, **fields: Any) -> Any:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(
        base_url=ctx.base_url, api_key=ctx.api_key, model=ctx.model, temperature=0,  # type: ignore[arg-type]
        max_tokens=MAX_TOKENS, timeout=ctx.timeout_s, max_retries=0,  # type: ignore[call-arg]
        http_client=ctx.http_client(), **fields,
    )  # fmt: skip


def _lc_calls(message: Any, forced: str | None = None) -> str:
    expect(not message.invalid_tool_calls, f"invalid_tool_calls {message.invalid_tool_calls}")
    expect(message.tool_calls, f"no tool calls; content={str(message.content)[:80]!r}")
    return "; ".join(check_call(c["name"], c["args"], forced) for c in message.tool_calls)


def lc_invoke(ctx: CaseContext) -> str:
    message = _chat_model(ctx).invoke("Say hello in one sentence.")
    expect(isinstance(message.content, str) and message.content, "empty content")
    return f"content {len(message.content)} chars"


def lc_bind_tools_required(ctx: CaseContext) -> str:
    return _lc_calls(
        _chat_model(ctx).bind_tools(CHAT_TOOLS, tool_choice="required").invoke(WEATHER)
    )


def lc_bind_tools_named(ctx: CaseContext) -> str:
    message = _chat_model(ctx).bind_tools(CHAT_TOOLS, tool_choice="get_time").invoke(TIME)
    return _lc_calls(message, "get_time")


def lc_bind_tools_auto(ctx: CaseContext) -> str:
    message = _chat_model(ctx).bind_tools(CHAT_TOOLS).invoke(WEATHER)
    if message.tool_calls or message.invalid_tool_calls:
        return _lc_calls(message)
    expect(message.content, "neither content nor calls")
    return f"content {len(str(message.content))} chars"


def lc_bind_tools_stream(ctx: CaseContext) -> str:
    bound = _chat_model(ctx).bind_tools(CHAT_TOOLS, tool_choice="required")
    message = None
    for chunk in bound.stream(WEATHER):
        message = chunk if message is None else message + chunk
    expect(message is not None, "no chunks")
    return _lc_calls(message)


def lc_tool_loop(ctx: CaseContext) -> str:
    from langchain_core.messages import HumanMessage, ToolMessage

    model = _chat_model(ctx)
    messages: list[Any] = [HumanMessage(WEATHER)]
    first = model.bind_tools(CHAT_TOOLS, tool_choice="required").invoke(messages)
    detail = _lc_calls(first)
    messages.append(first)
    messages += [ToolMessage("Sunny, 21 C", tool_call_id=c["id"]) for c in first.tool_calls]
    final = model.bind_tools(CHAT_TOOLS).invoke(messages)
    if final.tool_calls or final.invalid_tool_calls:
        return f"{detail} -> {_lc_calls(final)}"
    expect(final.content, "final answer empty")
    return f"{detail} -> content {len(str(final.content))} chars"


def _lc_structured(ctx: CaseContext, method: str, **fields: Any) -> str:
    result = _chat_model(ctx, **fields).with_structured_output(Person, method=method).invoke(PERSON)
    expect(isinstance(result, Person), f"result {result!r}")
    return repr(result)


def lc_structured_json_schema(ctx: CaseContext) -> str:
    return _lc_structured(ctx, "json_schema")


def lc_structured_function_calling(ctx: CaseContext) -> str:
    return _lc_structured(ctx, "function_calling")


def lc_structured_json_mode(ctx: CaseContext) -> str:
    return _lc_structured(ctx, "json_mode")


def lc_responses_bind_tools_required(ctx: CaseContext) -> str:
    model = _chat_model(ctx, use_responses_api=True)
    return _lc_calls(model.bind_tools(CHAT_TOOLS, tool_choice="required").invoke(WEATHER))


def lc_responses_structured_json_schema(ctx: CaseContext) -> str:
    return _lc_structured(ctx, "json_schema", use_responses_api=True)
