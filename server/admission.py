"""Admission control: the queue limits behind 429, and a Retry-After from the drain rate.

"Queued" means accepted by the server but not yet given a first token (or ended): those
requests are what a new arrival waits behind. Two limits apply, requests and prompt tokens.
Retry-After is the time the current queue takes to drain at the rate requests (or tokens)
recently left it, so it grows with load instead of being a constant.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 120


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a request was refused: `reason` is the metric label, `message` is for the user."""

    reason: str  # "queue_full" | "queued_tokens_full"
    message: str
    retry_after_s: int


@dataclass(slots=True)
class _Departure:
    at: float  # time.monotonic seconds
    num_tokens: int


@dataclass(slots=True)
class Admission:
    """Counts of queued requests and tokens; decides whether a new group of requests fits.

    Invariants: num_queued >= 0, queued_tokens >= 0; every enter() is matched by one leave().
    """

    max_waiting_requests: int
    max_queued_tokens: int
    window_s: float = 30.0  # how far back the drain rate looks
    num_queued: int = 0
    queued_tokens: int = 0
    _departures: deque[_Departure] = field(default_factory=deque)

    def check(self, num_requests: int, num_tokens: int, now: float) -> Rejection | None:
        # An empty queue admits anything, so one request larger than a limit is not refused
        # forever (the context-length check bounds its size).
        if self.num_queued == 0:
            return None
        if self.num_queued + num_requests > self.max_waiting_requests:
            return Rejection(
                "queue_full",
                f"server is at capacity: {self.num_queued} requests are waiting "
                f"(limit {self.max_waiting_requests}); retry later",
                self._retry_after(now, by_tokens=False),
            )
        if self.queued_tokens + num_tokens > self.max_queued_tokens:
            return Rejection(
                "queued_tokens_full",
                f"server is at capacity: {self.queued_tokens} prompt tokens are waiting "
                f"(limit {self.max_queued_tokens}); retry later",
                self._retry_after(now, by_tokens=True),
            )
        return None

    def enter(self, num_tokens: int) -> None:
        self.num_queued += 1
        self.queued_tokens += num_tokens

    def leave(self, num_tokens: int, now: float) -> None:
        self.num_queued -= 1
        self.queued_tokens -= num_tokens
        assert self.num_queued >= 0 and self.queued_tokens >= 0, "admission counts went negative"
        self._departures.append(_Departure(now, num_tokens))
        self._prune(now)

    def drain_rate(self, now: float, by_tokens: bool) -> float | None:
        """Requests (or tokens) per second that left the queue in the recent window."""
        self._prune(now)
        if not self._departures:
            return None
        span = max(now - self._departures[0].at, 1.0)
        if by_tokens:
            return sum(d.num_tokens for d in self._departures) / span
        return len(self._departures) / span

    def _retry_after(self, now: float, by_tokens: bool) -> int:
        backlog = self.queued_tokens if by_tokens else self.num_queued
        rate = self.drain_rate(now, by_tokens)
        if rate is None or rate <= 0:
            # Nothing left the queue within the window: the queue is at least that slow.
            seconds = self.window_s
        else:
            seconds = backlog / rate
        return int(min(max(math.ceil(seconds), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def _prune(self, now: float) -> None:
        while self._departures and now - self._departures[0].at > self.window_s:
            self._departures.popleft()
