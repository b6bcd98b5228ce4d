"""Python-list calls (vLLM's `pythonic` parser; Llama 3.2 / 4 and others' templates):

    [get_weather(city="Paris", unit="celsius"), add(a=2, b=3)]

the whole output (after whitespace), optionally inside `<|python_start|>` `<|python_end|>`.
Arguments are keywords whose values are Python literals; `true`, `false` and `null` are read
as JSON's too (forced calls write values as JSON). Anything else is content
(server/tool_parsers/region.py).

A forced call (required, named) writes the required parameters only, in the schema's order,
each value as JSON following its property's schema: a pythonic call has no JSON object to
hand the whole parameters schema to.
"""

from __future__ import annotations

import ast
from typing import Any

from server.tool_parsers.base import ToolCall, json_arguments, make_call
from server.tool_parsers.region import RegionFormat

PYTHON_START = "<|python_start|>"
PYTHON_END = "<|python_end|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}


class PythonicFormat(RegionFormat):
    name = "pythonic"
    markers = (PYTHON_START, "[")

    def read_region(self, region: str) -> list[ToolCall] | None:
        text = region.removeprefix(PYTHON_START).strip().removesuffix(PYTHON_END).strip()
        if not (text.startswith("[") and text.endswith("]")):
            return None
        try:
            tree = ast.parse(text, mode="eval").body
        except (SyntaxError, ValueError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = [_call(node) for node in tree.elts]
        return None if any(call is None for call in calls) else calls  # type: ignore[return-value]

    def call_tag(self, tool: Any) -> dict[str, Any]:
        schema = tool.parameters_schema
        properties = schema.get("properties") or {}
        elements: list[dict[str, Any]] = []
        for key in schema.get("required") or ():
            prefix = ", " if elements else ""
            elements.append({"type": "const_string", "value": f"{prefix}{key}="})
            elements.append(json_arguments(properties.get(key, {})))
        content = {"type": "sequence", "elements": elements} if elements else _EMPTY
        return {"type": "tag", "begin": f"{tool.name}(", "content": content, "end": ")"}

    def forced_format(self, tools: Any, one_call: bool) -> dict[str, Any]:
        calls = super().forced_format(tools, one_call)
        if calls["type"] == "tags_with_separator":
            calls = {**calls, "separator": ", "}  # inside a list: "]" ends it
        return {
            "type": "sequence",
            "elements": [
                {"type": "const_string", "value": "["},
                calls,
                {"type": "const_string", "value": "]"},
            ],
        }


_EMPTY = {"type": "const_string", "value": ""}


def _call(node: ast.expr) -> ToolCall | None:
    if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, ast.Name):
        return None
    arguments = {}
    for keyword in node.keywords:
        if keyword.arg is None:  # **kwargs
            return None
        try:
            arguments[keyword.arg] = _literal(keyword.value)
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return make_call(node.func.id, arguments)


def _literal(node: ast.expr) -> Any:
    """A Python literal's value, JSON's true/false/null included (ValueError otherwise)."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.List):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        if any(key is None for key in node.keys):
            raise ValueError("** in a dict")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values, strict=True)}
    return ast.literal_eval(node)
