"""Qwen3-Coder's XML format (vLLM's `qwen3_coder` parser):

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

The tag rules are server/tool_parsers/tagged.py's. A body is a call when it is one
`<function=NAME>` holding only `<parameter=KEY>VALUE</parameter>` entries (and whitespace),
the `</function>` optional at the end of an output that was cut. One newline either side of
a value is the format's, not the value's. Values are text; as vLLM, a parameter the tool's
schema types as other than a string is read as JSON when it parses (42, true, {"a": 1}),
and stays text otherwise or when the parameter is not in the schema.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import (
    MAX_WHITESPACE,
    ParsedOutput,
    ToolCall,
    ToolCallFormat,
    make_call,
)
from server.tool_parsers.tagged import TaggedStreamParser, parse_tagged

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)(?:</function>\s*)?\Z", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.DOTALL)


class Qwen3CoderFormat(ToolCallFormat):
    name = "qwen3_coder"

    def parse(self, text: str, max_calls: int | None = None) -> ParsedOutput:
        return parse_tagged(text, TOOL_CALL_START, TOOL_CALL_END, self.call_of, max_calls)

    def stream(self, max_calls: int | None = None) -> TaggedStreamParser:
        return TaggedStreamParser(TOOL_CALL_START, TOOL_CALL_END, self.call_of, max_calls)

    def call_of(self, body: str) -> ToolCall | None:
        match = _FUNCTION.match(body)
        if match is None:
            return None
        name, inner = match.group(1).strip(), match.group(2)
        if "</function>" in inner:
            return None
        arguments: dict[str, Any] = {}
        position = 0
        for parameter in _PARAMETER.finditer(inner):
            if inner[position : parameter.start()].strip():
                return None  # text between parameters: not this format
            key = parameter.group(1).strip()
            arguments[key] = self._value(name, key, _strip_newline(parameter.group(2)))
            position = parameter.end()
        if inner[position:].strip():
            return None
        return make_call(name, arguments)

    def _value(self, function: str, key: str, text: str) -> Any:
        tool = self.tools.get(function)
        properties = (tool.parameters_schema.get("properties") or {}) if tool else {}
        kind = (properties.get(key) or {}).get("type", "string")
        if key not in properties or kind == "string":
            return text
        try:
            return json.loads(text)
        except ValueError:
            return text

    def call_tag(self, tool: Any) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f"{TOOL_CALL_START}\n<function={tool.name}>\n",
            "content": {
                "type": "json_schema",
                "json_schema": tool.parameters_schema,
                "style": "qwen_xml",
                "max_whitespace_cnt": MAX_WHITESPACE,
            },
            "end": f"\n</function>\n{TOOL_CALL_END}",
        }


def _strip_newline(value: str) -> str:
    value = value.removeprefix("\n")
    return value.removesuffix("\n")
