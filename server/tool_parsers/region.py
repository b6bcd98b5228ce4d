"""Calls that run from a marker to the end of the output (llama3_json, mistral, pythonic).

A format says where its call region may begin, and reads the region as a list of calls:

- `anywhere` false (llama3_json, pythonic): only at the start of the output, after
  whitespace, with one of `markers` (`{`, `[`, `<|python_tag|>`...);
- `anywhere` true (mistral): at the first `markers` occurrence; the text before it is
  content (its trailing whitespace dropped when calls follow).

When the region does not read as calls, the whole output is content, as vLLM's parsers
leave it; calls past max_calls are dropped. The stream parser streams content until a
marker could begin (holding a tail that may be a marker's start, and whitespace a call
would drop), then holds the region until the output ends: which calls it holds is only
known then. Streamed and whole parses agree for every split (tests check each fixture).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import ClassVar

from server.tool_parsers.base import (
    CallDelta,
    ContentDelta,
    ParsedOutput,
    StreamDelta,
    ToolCall,
    ToolCallFormat,
)
from server.tool_parsers.tagged import partial_prefix_length


class RegionFormat(ToolCallFormat):
    markers: ClassVar[tuple[str, ...]]
    anywhere: ClassVar[bool] = False

    @abstractmethod
    def read_region(self, region: str) -> list[ToolCall] | None:
        """The calls the region (from its marker to the end) holds; None: not calls."""

    def region_start(self, text: str) -> int:
        """Where the call region begins in `text`, or -1."""
        if self.anywhere:
            found = [i for i in (text.find(m) for m in self.markers) if i >= 0]
            return min(found, default=-1)
        stripped = text.lstrip()
        if any(stripped.startswith(marker) for marker in self.markers):
            return len(text) - len(stripped)
        return -1

    def parse(self, text: str, max_calls: int | None = None) -> ParsedOutput:
        start = self.region_start(text)
        calls = self.read_region(text[start:]) if start >= 0 else None
        if not calls:
            return ParsedOutput(text, ())
        return ParsedOutput(text[:start].rstrip() or None, tuple(calls[:max_calls]))

    def stream(self, max_calls: int | None = None) -> RegionStreamParser:
        return RegionStreamParser(self, max_calls)


class RegionStreamParser:
    """RegionFormat.parse() applied to text arriving in pieces.

    Invariant: the text fed so far = the content emitted + `held` (before the region) or
    `separator + region` (inside it); once `passthrough`, all of it was emitted."""

    def __init__(self, fmt: RegionFormat, max_calls: int | None = None) -> None:
        self.fmt = fmt
        self.max_calls = max_calls
        self.num_calls = 0
        self.held = ""
        self.separator = ""  # the whitespace before the region, dropped if it holds calls
        self.region: str | None = None
        self.passthrough = False  # a leading format's output began otherwise: all content

    def feed(self, text: str) -> list[StreamDelta]:
        if self.region is not None:
            self.region += text
            return []
        if self.passthrough:
            return [ContentDelta(text)] if text else []
        pending = self.held + text
        start = self.fmt.region_start(pending)
        if start >= 0:
            before = pending[:start]
            self.separator = before[len(before.rstrip()) :]
            self.region, self.held = pending[start:], ""
            return _content(before.rstrip())
        if not self.fmt.anywhere:
            stripped = pending.lstrip()
            if stripped and not any(m.startswith(stripped) for m in self.fmt.markers):
                self.passthrough, self.held = True, ""
                return _content(pending)
            self.held = pending
            return []
        keep = max(partial_prefix_length(pending, m) for m in self.fmt.markers)
        head, partial = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.held = head[len(head.rstrip()) :] + partial
        return _content(head.rstrip())

    def update(self, text: str, finished: bool) -> list[StreamDelta]:
        deltas = self.feed(text) if text else []
        return deltas + self.finish() if finished else deltas

    def finish(self) -> list[StreamDelta]:
        if self.region is None:
            held, self.held = self.held, ""
            return _content(held)
        calls = self.fmt.read_region(self.region)
        if not calls:
            region, self.region = self.separator + self.region, ""
            return _content(region)
        self.num_calls = len(calls)
        return [CallDelta(i, call) for i, call in enumerate(calls[: self.max_calls])]


def _content(text: str) -> list[StreamDelta]:
    return [ContentDelta(text)] if text else []
