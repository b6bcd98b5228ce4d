"""StreamTiming: one OpenAI-style SSE stream, read line by line, timed at each content chunk.

Shared by the locust users (requests) and the serving benchmark (httpx) so both measure the
same thing the same way:
- TTFT = first chunk carrying text − request sent;
- ITL = gap between consecutive chunks carrying text (a chunk may carry more than one token);
- TPOT = (end − first chunk) / (completion_tokens − 1), from usage;
- e2e = end of stream − request sent.
No locust import here.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass(slots=True)
class StreamTiming:
    """Accumulates one stream. Times are time.perf_counter() seconds."""

    sent_at: float
    first_chunk_at: float | None = None
    last_chunk_at: float | None = None
    ended_at: float | None = None
    gaps: list[float] = field(default_factory=list)
    num_chunks: int = 0
    text: list[str] = field(default_factory=list)
    usage: dict | None = None
    error: str | None = None
    done: bool = False  # saw `data: [DONE]`

    def feed(self, line: str | bytes, now: float) -> None:
        """One line of the body; blank lines, comments and non-data fields are ignored."""
        if isinstance(line, bytes):
            line = line.decode("utf-8", errors="replace")
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.done = True
            return
        try:
            event = json.loads(data)
        except json.JSONDecodeError:
            self.error = f"malformed SSE data: {data[:200]!r}"
            return
        if "error" in event:
            err = event["error"]
            self.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
            return
        if event.get("usage"):
            self.usage = event["usage"]
        piece = "".join(_choice_text(c) for c in event.get("choices") or [])
        if piece:
            self._on_text(piece, now)

    def _on_text(self, piece: str, now: float) -> None:
        if self.last_chunk_at is None:
            self.first_chunk_at = now
        else:
            self.gaps.append(now - self.last_chunk_at)
        self.last_chunk_at = now
        self.num_chunks += 1
        self.text.append(piece)

    def finish(self, now: float) -> None:
        self.ended_at = now

    @property
    def ttft(self) -> float | None:
        return None if self.first_chunk_at is None else self.first_chunk_at - self.sent_at

    @property
    def e2e(self) -> float | None:
        return None if self.ended_at is None else self.ended_at - self.sent_at

    @property
    def completion_tokens(self) -> int | None:
        return None if self.usage is None else int(self.usage.get("completion_tokens", 0))

    @property
    def prompt_tokens(self) -> int | None:
        return None if self.usage is None else int(self.usage.get("prompt_tokens", 0))

    @property
    def tpot(self) -> float | None:
        n = self.completion_tokens
        if n is None or n < 2 or self.first_chunk_at is None or self.ended_at is None:
            return None
        return (self.ended_at - self.first_chunk_at) / (n - 1)

    def failure(self) -> str | None:
        """Why this stream did not succeed, or None."""
        if self.error:
            return f"stream error: {self.error}"
        if not self.done:
            return "stream ended without [DONE]"
        if self.usage is None:
            return "stream had no usage chunk (stream_options.include_usage)"
        return None


def _choice_text(choice: dict) -> str:
    if "delta" in choice:  # chat.completion.chunk
        return (choice.get("delta") or {}).get("content") or ""
    return choice.get("text") or ""  # text_completion


def error_message(body: bytes | str) -> str:
    """The message of an OpenAI error body, or the body's start."""
    try:
        payload = json.loads(body)
        err = payload.get("error", payload) if isinstance(payload, dict) else payload
        return str(err.get("message", err)) if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
        return (body.decode(errors="replace") if isinstance(body, bytes) else body)[:200]
