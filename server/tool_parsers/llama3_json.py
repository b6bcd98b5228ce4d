"""Llama 3.1/3.2/3.3's JSON calls (vLLM's `llama3_json` parser): the whole output is

    {"name": "get_weather", "parameters": {"city": "Paris"}}

optionally after `<|python_tag|>`, several calls separated by `;` (or nothing). `arguments`
is read as `parameters`' synonym. An output that does not begin with a call (after
whitespace), or is anything but calls from there on, is content (server/tool_parsers/region.py).
"""

from __future__ import annotations

import json
from typing import Any

from server.tool_parsers.base import ToolCall, json_arguments, make_call
from server.tool_parsers.region import RegionFormat

PYTHON_TAG = "<|python_tag|>"
_DECODER = json.JSONDecoder()


class Llama3JsonFormat(RegionFormat):
    name = "llama3_json"
    markers = (PYTHON_TAG, "{")

    def read_region(self, region: str) -> list[ToolCall] | None:
        text = region.removeprefix(PYTHON_TAG)
        calls: list[ToolCall] = []
        position = 0
        while True:
            position = _skip(text, position, calls)
            if position >= len(text):
                return calls
            try:
                value, position = _DECODER.raw_decode(text, position)
            except ValueError:
                return None
            if not isinstance(value, dict):
                return None
            call = make_call(value.get("name"), value.get("parameters", value.get("arguments")))
            if call is None:
                return None
            calls.append(call)

    def call_tag(self, tool: Any) -> dict[str, Any]:
        return {
            "type": "tag",
            "begin": f'{{"name": {json.dumps(tool.name)}, "parameters": ',
            "content": json_arguments(tool.parameters_schema),
            "end": "}",
        }


def _skip(text: str, position: int, calls: list[ToolCall]) -> int:
    """Past whitespace, and one `;` between calls."""
    while position < len(text) and text[position].isspace():
        position += 1
    if calls and text.startswith(";", position):
        position += 1
        while position < len(text) and text[position].isspace():
            position += 1
    return position
