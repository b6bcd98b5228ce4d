"""Calls written as tags, `START body END`, with content around them (hermes, qwen3_coder).

The rules, the same for the whole output (parse_tagged) and the stream (TaggedStreamParser;
tests check both agree on every split):

- a tag runs from START to the first END after it, or to the end of the output when it
  never closes (a generation stopped right after the call);
- a tag is a call when the format's `call_of(body)` reads one; any other tag stays in the
  content as text, as vLLM leaves unparseable output as content;
- whitespace between a call and the text around it separates them and is dropped; the rest
  of the text, in order, is the content (None when only calls remain);
- with `max_calls`, calls past it are dropped (parallel_tool_calls false keeps the first).

The stream holds back text that may still turn into a call: a tail that could be the start
of START, whitespace that would be dropped if a call follows, and a tag until END closes it
(or the output ends). Each call is emitted whole once its tag closes: OpenAI clients
accumulate argument fragments, and one fragment is a valid sequence of them.
"""

from __future__ import annotations

from collections.abc import Callable

from server.tool_parsers.base import CallDelta, ContentDelta, ParsedOutput, StreamDelta, ToolCall

CallReader = Callable[[str], ToolCall | None]


def parse_tagged(
    text: str, start_tag: str, end_tag: str, call_of: CallReader, max_calls: int | None
) -> ParsedOutput:
    """Calls and content of a finished output (the rules in the module docstring)."""
    pieces: list[str] = []  # content, in order
    calls: list[ToolCall] = []
    found_call = False
    after_call = False  # the next piece's leading whitespace separates it from a call
    position = 0
    while True:
        start = text.find(start_tag, position)
        if start < 0:
            pieces.append(_lstrip_if(text[position:], after_call))
            break
        body_start = start + len(start_tag)
        end = text.find(end_tag, body_start)
        tag_end = len(text) if end < 0 else end + len(end_tag)
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


class TaggedStreamParser:
    """parse_tagged() applied to text arriving in pieces.

    Invariant: the text fed so far = the content emitted + the calls' tags (with the
    whitespace around them) + `held` (outside a tag) or `separator + START + body` (inside)."""

    def __init__(
        self, start_tag: str, end_tag: str, call_of: CallReader, max_calls: int | None = None
    ) -> None:
        self.start_tag, self.end_tag, self.call_of = start_tag, end_tag, call_of
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
        start = pending.find(self.start_tag)
        if start >= 0:
            before = pending[:start]
            _emit(before.rstrip(), deltas)
            self.separator = before[len(before.rstrip()) :]
            self.held, self.in_tag, self.body = "", True, ""
            return pending[start + len(self.start_tag) :]
        keep = partial_prefix_length(pending, self.start_tag)
        head, partial = pending[: len(pending) - keep], pending[len(pending) - keep :]
        _emit(head.rstrip(), deltas)
        self.held = head[len(head.rstrip()) :] + partial
        return ""

    def _feed_tag(self, text: str, deltas: list[StreamDelta]) -> str:
        """Consume text inside a tag; return what follows its END ("" while it is open)."""
        self.body += text
        end = self.body.find(self.end_tag)
        if end < 0:
            return ""
        rest = self.body[end + len(self.end_tag) :]
        self.body = self.body[:end]
        self._close_tag(closed=True, deltas=deltas)
        return rest

    def _close_tag(self, *, closed: bool, deltas: list[StreamDelta]) -> None:
        call = self.call_of(self.body)
        if call is None:
            tag = self.start_tag + self.body + (self.end_tag if closed else "")
            _emit(self.separator + tag, deltas)
        else:
            if self.max_calls is None or self.num_calls < self.max_calls:
                deltas.append(CallDelta(self.num_calls, call))
            self.num_calls += 1
            self.after_call = True
        self.in_tag, self.separator, self.body = False, "", ""


def _emit(text: str, deltas: list[StreamDelta]) -> None:
    if text:
        deltas.append(ContentDelta(text))


def partial_prefix_length(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for length in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0
