"""What every tool-call format gives: parsed calls as plain values, and the parser interface.

A format (one module per family, server/tool_parsers/__init__.py lists them) reads calls
out of a model's text two ways that must agree: `parse()` of the whole output, and
`stream()`, a parser fed the text piece by piece whose content deltas, concatenated, and
calls equal parse()'s for every split of the text (tests/unit/test_tool_parsers.py checks
each fixture at every chunk boundary). Output a format cannot read is content, never an
error. `forced_format()` is the xgrammar structural-tag format a required or named
tool_choice constrains the output with, written the way that format's parser reads it.
"""

from __future__ import annotations

import json
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

if TYPE_CHECKING:  # server.tool_calls imports this package: no import cycle at run time
    from server.tool_calls.tools import FunctionTool

# Consecutive whitespace characters allowed inside forced arguments: a small model left free
# whitespace can spend its whole budget on it.
MAX_WHITESPACE = 1


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


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # the call's position among the choice's calls (OpenAI's tool_calls[].index)
    call: ToolCall


StreamDelta = ContentDelta | CallDelta


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def make_call(name: Any, arguments: Any) -> ToolCall | None:
    """A call when `name` is a string and `arguments` an object (None: {}); else None."""
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError):  # a value JSON has no spelling for (a set, NaN, bytes)
        return None
    return ToolCall(new_call_id(), name, text)


class StreamParser(Protocol):
    """One choice's stream: feed() each text piece, then finish() once, for the deltas."""

    num_calls: int  # calls found so far, those past max_calls included

    def feed(self, text: str) -> list[StreamDelta]: ...

    def finish(self) -> list[StreamDelta]: ...


def stream_update(parser: StreamParser, text: str, finished: bool) -> list[StreamDelta]:
    """feed() one generation update's text, then finish() if it was the last."""
    deltas = parser.feed(text) if text else []
    return deltas + parser.finish() if finished else deltas


class ToolCallFormat(ABC):
    """One family's way of writing calls, for one request's tools (a parser may read the
    parameters' types from them)."""

    name: ClassVar[str]  # vLLM's --tool-call-parser name
    # The format's markers are special tokens that skip_special_tokens would drop from the
    # text (mistral's [TOOL_CALLS]): the route keeps special tokens when it parses calls.
    needs_special_tokens: ClassVar[bool] = False

    def __init__(self, tools: Sequence[FunctionTool] = ()) -> None:
        self.tools = {tool.name: tool for tool in tools}

    @abstractmethod
    def parse(self, text: str, max_calls: int | None = None) -> ParsedOutput: ...

    @abstractmethod
    def stream(self, max_calls: int | None = None) -> StreamParser: ...

    @abstractmethod
    def call_tag(self, tool: FunctionTool) -> dict[str, Any]:
        """The structural tag of one call to `tool`, its arguments following its schema."""

    def forced_format(self, tools: Sequence[FunctionTool], one_call: bool) -> dict[str, Any]:
        """The calls a required (any of `tools`) or named (one tool, `one_call`) choice
        allows: calls back to back, the turn allowed to end after each. No separator between
        them: after a call, a newline is the token a model likes best whatever it means to do
        next (SmolLM2-135M: p 0.61 against 0.33 for end of turn), so a separator committed
        it to another call and it repeated the call until max_tokens."""
        if one_call and len(tools) == 1:
            return self.call_tag(tools[0])
        return {
            "type": "tags_with_separator",
            "tags": [self.call_tag(tool) for tool in tools],
            "separator": "",
            "at_least_one": True,
            "stop_after_first": one_call,
        }


def json_arguments(schema: dict[str, Any]) -> dict[str, Any]:
    """A structural-tag content: JSON following `schema`, at most MAX_WHITESPACE in a row."""
    return {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE}
