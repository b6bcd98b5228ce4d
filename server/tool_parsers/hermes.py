"""The hermes format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Hermes 2 Pro/3, Qwen2/2.5/3 and SmolLM2's tool-use prompts (meterserve's own, for a template
without tools: server/tool_calls/prompt.py) all ask for it; vLLM's `hermes` parser. A tag's
body is a call when it is a JSON object with a string `name` and an object `arguments`
(absent means `{}`); the tag rules are server/tool_parsers/tagged.py's.
"""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers.base import (
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    json_arguments,
    make_call,
)
from server.tool_parsers.tagged import TaggedStreamParser, parse_tagged

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


def call_of(body: str) -> ToolCall | None:
    """The call a tag's body holds, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict):
        return None
    return make_call(value.get("name"), value.get("arguments", {}))


def parse_tool_calls(text: str, max_calls: int | None = None) -> ParsedOutput:
    """Calls and content of a finished hermes output."""
    return parse_tagged(text, TOOL_CALL_START, TOOL_CALL_END, call_of, max_calls)


class HermesStreamParser(TaggedStreamParser):
    def __init__(self, max_calls: int | None = None) -> None:
        super().__init__(TOOL_CALL_START, TOOL_CALL_END, call_of, max_calls)


class HermesFormat(ToolCallFormat):
    name = "hermes"

    def parse(self, text: str, max_calls: int | None = None) -> ParsedOutput:
        return parse_tool_calls(text, max_calls)

    def stream(self, max_calls: int | None = None) -> HermesStreamParser:
        return HermesStreamParser(max_calls)

    def call_tag(self, tool: Any) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{TOOL_CALL_START}\n{{"name": {json.dumps(tool.name)}, "arguments": ',
            "content": json_arguments(tool.parameters_schema),
            "end": f"}}\n{TOOL_CALL_END}",
        }
