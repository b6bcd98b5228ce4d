"""Mistral's calls (vLLM's `mistral` parser), after the `[TOOL_CALLS]` special token:

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, ...]   (v3 tokenizers)
    [TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}                               (v11+)

Text before the first `[TOOL_CALLS]` is content; from it to the end of the output is calls,
one or more `[TOOL_CALLS]` segments, each a JSON array of calls or `name[ARGS]{...}` (the
`[ARGS]` optional). Anything else there makes the whole output content
(server/tool_parsers/region.py). `[TOOL_CALLS]` is a special token, so the route keeps
special tokens' text for this format (as vLLM does).
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.tool_parsers.base import ToolCall, json_arguments, make_call
from server.tool_parsers.region import RegionFormat

TOOL_CALLS = "[TOOL_CALLS]"
_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)(?:\[ARGS\])?")
_DECODER = json.JSONDecoder()


class MistralFormat(RegionFormat):
    name = "mistral"
    markers = (TOOL_CALLS,)
    anywhere = True
    needs_special_tokens = True

    def read_region(self, region: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        for segment in region.split(TOOL_CALLS)[1:]:
            found = _segment_calls(segment)
            if found is None:
                return None
            calls += found
        return calls

    def call_tag(self, tool: Any) -> dict[str, Any]:
        # One call per segment, so calls follow each other with no separator (base.py).
        return {
            "type": "tag",
            "begin": f'{TOOL_CALLS}[{{"name": {json.dumps(tool.name)}, "arguments": ',
            "content": json_arguments(tool.parameters_schema),
            "end": "}]",
        }


def _segment_calls(segment: str) -> list[ToolCall] | None:
    text = segment.strip()
    if text.startswith("["):
        return _array_calls(text)
    named = _NAMED.match(text)
    if named is None:
        return None
    value = _json_value(text[named.end() :])
    call = make_call(named.group(1), value) if isinstance(value, dict) else None
    return None if call is None else [call]


def _array_calls(text: str) -> list[ToolCall] | None:
    value = _json_value(text)
    if not isinstance(value, list) or not value:
        return None
    calls = []
    for item in value:
        if not isinstance(item, dict):
            return None
        arguments = item.get("arguments")
        if isinstance(arguments, str):  # some fine-tunes write the arguments as JSON text
            arguments = _json_value(arguments)
        call = make_call(item.get("name"), arguments)
        if call is None:
            return None
        calls.append(call)
    return calls


def _json_value(text: str) -> Any:
    """The one JSON value `text` is (whitespace around it allowed), or None."""
    try:
        value, end = _DECODER.raw_decode(text.strip())
    except ValueError:
        return None
    return value if end == len(text.strip()) else None
