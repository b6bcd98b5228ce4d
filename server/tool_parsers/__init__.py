"""Tool-call formats, one module per family, chosen by `--tool-call-parser` (vLLM's names):

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>   (the default)
    qwen3_coder  <tool_call><function=NAME><parameter=KEY>VALUE</parameter></function></tool_call>
    llama3_json  {"name": ..., "parameters": {...}}  (optionally after <|python_tag|>)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}]  or  [TOOL_CALLS]NAME[ARGS]{...}
    pythonic     [NAME(KEY=VALUE, ...), ...]

or `auto`: picked from the chat template's text (auto_format_name). A route gets the format
for its request's tools (`tool_call_format(name, template, tools)`), parses calls with its
parse() or stream(), and a required or named tool_choice is constrained by its
forced_format() (server/tool_calls/constraint.py).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from server.tool_parsers.base import (
    CallDelta,
    ContentDelta,
    ParsedOutput,
    StreamDelta,
    StreamParser,
    ToolCall,
    ToolCallFormat,
    stream_update,
)
from server.tool_parsers.hermes import HermesFormat
from server.tool_parsers.llama3_json import Llama3JsonFormat
from server.tool_parsers.mistral import MistralFormat
from server.tool_parsers.pythonic import PythonicFormat
from server.tool_parsers.qwen3_coder import Qwen3CoderFormat

FORMATS: dict[str, type[ToolCallFormat]] = {
    fmt.name: fmt
    for fmt in (HermesFormat, Qwen3CoderFormat, Llama3JsonFormat, MistralFormat, PythonicFormat)
}
PARSER_NAMES = (*FORMATS, "auto")  # --tool-call-parser's choices
DEFAULT_PARSER = "hermes"

# What a family's chat template says about its call format, tested in this order: Qwen3-
# Coder's XML also uses <tool_call>, so it goes before hermes; Llama 4 and 3.2's pythonic
# templates show `[func_name1(`; Llama 3.1's JSON templates `"parameters"` and python_tag.
_TEMPLATE_SIGNS = (
    ("qwen3_coder", re.compile(r"<function=|<parameter=")),
    ("hermes", re.compile(r"<tool_call>")),
    ("mistral", re.compile(r"\[TOOL_CALLS\]")),
    ("pythonic", re.compile(r"\[func_name\d*\(|<\|python_start\|>")),
    ("llama3_json", re.compile(r"<\|python_tag\|>|\"parameters\": dictionary")),
)


def auto_format_name(chat_template: str | None) -> str:
    """The format a chat template asks for; hermes when it shows none (meterserve's own
    hermes prompt renders tools for a template that knows none)."""
    for name, sign in _TEMPLATE_SIGNS:
        if chat_template and sign.search(chat_template):
            return name
    return DEFAULT_PARSER


def tool_call_format(
    parser: str, chat_template: str | None, tools: Sequence[Any] = ()
) -> ToolCallFormat:
    """The format `--tool-call-parser parser` means for this template, for these tools."""
    name = auto_format_name(chat_template) if parser == "auto" else parser
    return FORMATS[name](tools)


__all__ = [
    "DEFAULT_PARSER",
    "FORMATS",
    "PARSER_NAMES",
    "CallDelta",
    "ContentDelta",
    "ParsedOutput",
    "StreamDelta",
    "StreamParser",
    "ToolCall",
    "ToolCallFormat",
    "auto_format_name",
    "stream_update",
    "tool_call_format",
]
