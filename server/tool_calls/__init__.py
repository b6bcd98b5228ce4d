"""Tool calling, shared by every endpoint that takes function tools (docs/api.md#tool-calling).

A route turns its request's tools into FunctionTool values and its tool_choice into a
ToolChoice, then:

    policy = resolve_tool_policy(tools, choice, parallel)      # 400s naming the fields
    constraint = output_constraint(structured, policy, name)   # required/named: a grammar
    messages, tools_arg = conversation_for_template(messages, policy.tools, chat_template)
    ...generate...
    parsed = parse_tool_calls(text, policy.max_calls)          # if policy.parses_calls
    # or, streaming: HermesStreamParser(policy.max_calls).update(text, finished) per update
    finish_reason = finish_reason_of(reason, bool(parsed.tool_calls))

The one output format supported is hermes (`<tool_call>` JSON): Qwen2/2.5/3, Hermes and
SmolLM2 (through meterserve's own hermes prompt, its template having no tools).
"""

from __future__ import annotations

from server.tool_calls.constraint import output_constraint, tool_call_constraint
from server.tool_calls.hermes import ParsedOutput, ToolCall, parse_tool_calls
from server.tool_calls.prompt import conversation_for_template, template_renders_tools
from server.tool_calls.stream import CallDelta, ContentDelta, HermesStreamParser, StreamDelta
from server.tool_calls.tools import FunctionTool, ToolChoice, ToolPolicy, resolve_tool_policy


def finish_reason_of(reason: str | None, called: bool) -> str | None:
    """OpenAI's `tool_calls` for a choice that ended naturally (EOS) with calls; a choice cut
    by max_tokens stays `length`."""
    return "tool_calls" if called and reason == "stop" else reason


__all__ = [
    "CallDelta",
    "ContentDelta",
    "FunctionTool",
    "HermesStreamParser",
    "ParsedOutput",
    "StreamDelta",
    "ToolCall",
    "ToolChoice",
    "ToolPolicy",
    "conversation_for_template",
    "finish_reason_of",
    "output_constraint",
    "parse_tool_calls",
    "resolve_tool_policy",
    "template_renders_tools",
    "tool_call_constraint",
]
