"""The hermes tool-call format: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

Hermes 2 Pro/3, Qwen2/2.5/3 and SmolLM2's tool-use prompts all ask for it (vLLM's `hermes`
parser). parse_tool_calls() splits a finished output into calls and content; stream.py does
the same incrementally, with the same rules (tests check both agree on every split):

- a tag runs from `<tool_call>` to the first `</tool_call>` after it, or to the end of the
  output when it never closes (a generation stopped right after the JSON);
- a tag is a call when its body is a JSON object with a string `name` and an object
  `arguments` (absent means `{}`); any other tag stays in the content as text, as vLLM
  leaves unparseable output as content;
- whitespace between a call and the text around it separates them and is dropped; the rest
  of the text, in order, is the content (None when only calls remain);
- with `max_calls`, calls past it are dropped (parallel_tool_calls false keeps the first).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One parsed call; `arguments` is the arguments object as JSON text (OpenAI's shape)."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str | None  # the text outside calls; None when there were calls and nothing else
    tool_calls: tuple[ToolCall, ...]


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_of(body: str) -> ToolCall | None:
    """The call a tag's body holds, or None when it is not one."""
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", {})
    if not isinstance(arguments, dict):
        return None
    return ToolCall(new_call_id(), value["name"], json.dumps(arguments, ensure_ascii=False))


def parse_tool_calls(text: str, max_calls: int | None = None) -> ParsedOutput:
    """Calls and content of a finished output (the rules in the module docstring)."""
    pieces: list[str] = []  # content, in order
    calls: list[ToolCall] = []
    found_call = False
    after_call = False  # the next piece's leading whitespace separates it from a call
    position = 0
    while True:
        start = text.find(TOOL_CALL_START, position)
        if start < 0:
            pieces.append(_lstrip_if(text[position:], after_call))
            break
        body_start = start + len(TOOL_CALL_START)
        end = text.find(TOOL_CALL_END, body_start)
        tag_end = len(text) if end < 0 else end + len(TOOL_CALL_END)
        call = call_of(text[body_start : len(text) if end < 0 else end])
        before = _lstrip_if(text[position:start], after_call)
        if call is None:
            pieces.append(before + text[start:tag_end])
            after_call = False
        else:
            pieces.append(before.rstrip())
            found_call = after_call = True
            if max_calls is None or len(calls) < max_calls:
                calls.append(call)
        position = tag_end
        if position >= len(text):
            break
    content = "".join(pieces)
    if found_call and not content:
        return ParsedOutput(None, tuple(calls))
    return ParsedOutput(content, tuple(calls))


def _lstrip_if(text: str, strip: bool) -> str:
    return text.lstrip() if strip else text
