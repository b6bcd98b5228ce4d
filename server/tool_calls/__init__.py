"""Tool calling, shared by every endpoint that takes function tools (docs/api.md#tool-calling).

A route turns its request's tools into FunctionTool values and its tool_choice into a
ToolChoice, then:

    policy = resolve_tool_policy(tools, choice, parallel)           # 400s naming the fields
    fmt = tool_call_format(settings.tool_call_parser, template, policy.tools)
    constraint = output_constraint(structured, policy, client, fmt)  # required/named
    messages, tools_arg = conversation_for_template(messages, policy.tools, chat_template)
    ...generate...
    parsed = fmt.parse(text, policy.max_calls)                      # if policy.parses_calls
    # or, streaming: parser = fmt.stream(policy.max_calls); stream_update(parser, text, done)
    finish_reason = finish_reason_of(reason, bool(parsed.tool_calls))

The call formats (hermes, qwen3_coder, llama3_json, mistral, pythonic) are
server/tool_parsers'. The prompt is the chat template's, or meterserve's own hermes prompt
for a template without tools (SmolLM2's).
"""

from __future__ import annotations

from server.tool_calls.constraint import output_constraint, tool_call_constraint
from server.tool_calls.prompt import conversation_for_template, template_renders_tools
from server.tool_calls.tools import FunctionTool, ToolChoice, ToolPolicy, resolve_tool_policy
from server.tool_parsers import (
    CallDelta,
    ContentDelta,
    ParsedOutput,
    StreamDelta,
    StreamParser,
    ToolCall,
    ToolCallFormat,
    stream_update,
    tool_call_format,
)
from server.tool_parsers.hermes import HermesStreamParser, parse_tool_calls


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
    "StreamParser",
    "ToolCall",
    "ToolCallFormat",
    "ToolChoice",
    "ToolPolicy",
    "conversation_for_template",
    "finish_reason_of",
    "output_constraint",
    "parse_tool_calls",
    "resolve_tool_policy",
    "stream_update",
    "template_renders_tools",
    "tool_call_constraint",
    "tool_call_format",
]
