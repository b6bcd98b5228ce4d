"""Hermes tool calls parsed while the text streams: content deltas and whole calls.

The rules are hermes.py's; this applies them to text arriving in pieces. Text that may still
turn into a call is held back: a tail that could be the start of `<tool_call>`, whitespace
that would be dropped if a call follows, and a tag until `</tool_call>` closes it (or the
output ends). A tag that is not a call is released as content, so the concatenated content
deltas and the calls equal parse_tool_calls() of the whole text, however it was split.

Each call is emitted whole once its tag closes: OpenAI clients accumulate argument fragments,
and one fragment is a valid sequence of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from server.tool_calls.hermes import TOOL_CALL_END, TOOL_CALL_START, ToolCall, call_of


@dataclass(frozen=True, slots=True)
class ContentDelta:
    text: str


@dataclass(frozen=True, slots=True)
class CallDelta:
    index: int  # the call's position among the choice's calls (OpenAI's tool_calls[].index)
    call: ToolCall


StreamDelta = ContentDelta | CallDelta


class HermesStreamParser:
    """One choice's stream: feed() each text piece, then finish() once, for the deltas.

    Invariant: the text fed so far = the content emitted + the calls' tags (with the
    whitespace around them) + `held` (outside a tag) or `separator + START + body` (inside)."""

    def __init__(self, max_calls: int | None = None) -> None:
        self.max_calls = max_calls
        self.num_calls = 0  # calls found, dropped ones included
        self.held = ""  # outside a tag: text not yet emitted (trailing whitespace, a partial START)
        self.in_tag = False
        self.separator = ""  # inside a tag: the whitespace held back before it
        self.body = ""  # inside a tag: the text after START so far
        self.after_call = False  # leading whitespace of what follows a call is dropped

    def feed(self, text: str) -> list[StreamDelta]:
        deltas: list[StreamDelta] = []
        while text:
            text = self._feed_tag(text, deltas) if self.in_tag else self._feed_text(text, deltas)
        return deltas

    def update(self, text: str, finished: bool) -> list[StreamDelta]:
        """feed() one generation update's text, then finish() if it was the last."""
        deltas = self.feed(text) if text else []
        return deltas + self.finish() if finished else deltas

    def finish(self) -> list[StreamDelta]:
        """The deltas the end of the output releases: a tag that never closed, held text."""
        deltas: list[StreamDelta] = []
        if self.in_tag:
            self._close_tag(closed=False, deltas=deltas)
        if self.held:
            deltas.append(ContentDelta(self.held))
            self.held = ""
        return deltas

    def _feed_text(self, text: str, deltas: list[StreamDelta]) -> str:
        """Consume text outside a tag; return what follows a START found in it ("" if none)."""
        pending = self.held + text
        if self.after_call:
            pending = pending.lstrip()
            self.after_call = not pending
        start = pending.find(TOOL_CALL_START)
        if start >= 0:
            before = pending[:start]
            self._emit(before.rstrip(), deltas)
            self.separator = before[len(before.rstrip()) :]
            self.held, self.in_tag, self.body = "", True, ""
            return pending[start + len(TOOL_CALL_START) :]
        keep = _partial_start_length(pending)
        head, partial = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self._emit(head.rstrip(), deltas)
        self.held = head[len(head.rstrip()) :] + partial
        return ""

    def _feed_tag(self, text: str, deltas: list[StreamDelta]) -> str:
        """Consume text inside a tag; return what follows its END ("" while it is open)."""
        self.body += text
        end = self.body.find(TOOL_CALL_END)
        if end < 0:
            return ""
        rest = self.body[end + len(TOOL_CALL_END) :]
        self.body = self.body[:end]
        self._close_tag(closed=True, deltas=deltas)
        return rest

    def _close_tag(self, *, closed: bool, deltas: list[StreamDelta]) -> None:
        call = call_of(self.body)
        if call is None:
            tag = TOOL_CALL_START + self.body + (TOOL_CALL_END if closed else "")
            self._emit(self.separator + tag, deltas)
        else:
            if self.max_calls is None or self.num_calls < self.max_calls:
                deltas.append(CallDelta(self.num_calls, call))
            self.num_calls += 1
            self.after_call = True
        self.in_tag, self.separator, self.body = False, "", ""

    @staticmethod
    def _emit(text: str, deltas: list[StreamDelta]) -> None:
        if text:
            deltas.append(ContentDelta(text))


def _partial_start_length(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of START."""
    for length in range(min(len(text), len(TOOL_CALL_START) - 1), 0, -1):
        if TOOL_CALL_START.startswith(text[-length:]):
            return length
    return 0
