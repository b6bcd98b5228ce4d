"""Admission control: the queue limits behind 429, and a per-request Retry-After.

"Queued" means accepted by the server (`enter()`) and not yet left the queue (`leave()`). A
request leaves once: when it reaches its first token ("served"), or when it ends before that
(timed out, cancelled by its client, failed). Queued requests are what a new arrival waits
behind. Two limits apply, `max_waiting_requests` queued requests and `max_queued_tokens`
queued prompt tokens; an empty queue admits any group.

Retry-After for a refused group of `num_requests` requests with `num_tokens` prompt tokens is
the estimated wait until that group would fit, not the time to drain the whole queue:

    request limit:  min(num_queued + num_requests - max_waiting_requests, num_queued)
                    / served requests per second
    token limit:    min(queued_tokens + num_tokens - max_queued_tokens, queued_tokens)
                    / served prompt tokens per second

rounded up to whole seconds and clamped to [RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S]. The min()
is there because once the whole queue has left, the empty queue admits the group anyway.

The rates count only served departures in the last `window_s` seconds, divided by
max(now - oldest of them, 1 s), so a burst of first tokens does not read as an infinite rate.
Timeouts, disconnects and failures free room but say nothing about how fast the engine
serves; counting them would make a stuck queue look fast. With no served departure in the
window, Retry-After is `window_s` (clamped the same way): nothing was served for that long,
so any shorter wait would be a guess.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

RETRY_AFTER_MIN_S = 1
RETRY_AFTER_MAX_S = 120
MIN_RATE_SPAN_S = 1.0  # the drain rate is never measured over less than this


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
    """Counts of queued requests and tokens; decides whether a new group of requests fits and,
    if not, how long it should wait.

    Invariants: num_queued >= 0, queued_tokens >= 0; every enter() is matched by one leave();
    `_served` holds only served departures, oldest first, none older than `window_s` after
    the last prune.
    """

    max_waiting_requests: int
    max_queued_tokens: int
    window_s: float = 30.0  # how far back the drain rate looks
    num_queued: int = 0
    queued_tokens: int = 0
    _served: deque[_Departure] = field(default_factory=deque)

    def check(self, num_requests: int, num_tokens: int, now: float) -> Rejection | None:
        # An empty queue admits anything, so one request larger than a limit is not refused
        # forever (the context-length check bounds its size).
        if self.num_queued == 0:
            return None
        excess_requests = self.num_queued + num_requests - self.max_waiting_requests
        if excess_requests > 0:
            return Rejection(
                "queue_full",
                f"server is at capacity: {self.num_queued} requests are waiting "
                f"(limit {self.max_waiting_requests}); retry later",
                self._retry_after(min(excess_requests, self.num_queued), now, by_tokens=False),
            )
        excess_tokens = self.queued_tokens + num_tokens - self.max_queued_tokens
        if excess_tokens > 0:
            return Rejection(
                "queued_tokens_full",
                f"server is at capacity: {self.queued_tokens} prompt tokens are waiting "
                f"(limit {self.max_queued_tokens}); retry later",
                self._retry_after(min(excess_tokens, self.queued_tokens), now, by_tokens=True),
            )
        return None

    def enter(self, num_tokens: int) -> None:
        self.num_queued += 1
        self.queued_tokens += num_tokens

    def leave(self, num_tokens: int, now: float, served: bool = True) -> None:
        """One queued request left: `served` if it reached its first token, False if it timed
        out, was cancelled by its client or failed. Only served departures feed the rate."""
        self.num_queued -= 1
        self.queued_tokens -= num_tokens
        assert self.num_queued >= 0 and self.queued_tokens >= 0, "admission counts went negative"
        if served:
            self._served.append(_Departure(now, num_tokens))
        self._prune(now)

    def drain_rate(self, now: float, by_tokens: bool) -> float | None:
        """Served requests (or their prompt tokens) per second over the recent window; None
        when nothing was served in it."""
        self._prune(now)
        if not self._served:
            return None
        span = max(now - self._served[0].at, MIN_RATE_SPAN_S)
        if by_tokens:
            return sum(d.num_tokens for d in self._served) / span
        return len(self._served) / span

    def _retry_after(self, must_leave: int, now: float, by_tokens: bool) -> int:
        """Seconds until `must_leave` more requests (or prompt tokens) are served."""
        rate = self.drain_rate(now, by_tokens)
        if rate is None or rate <= 0:
            seconds = self.window_s  # nothing served within the window (see module docstring)
        else:
            seconds = must_leave / rate
        return int(min(max(math.ceil(seconds), RETRY_AFTER_MIN_S), RETRY_AFTER_MAX_S))

    def _prune(self, now: float) -> None:
        while self._served and now - self._served[0].at > self.window_s:
            self._served.popleft()
