"""WaitingQueue: requests not yet running, in the order the policy admits them."""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(order=True, slots=True)
class _HeapEntry:
    priority: int
    arrival_time: float
    seq: int  # insertion order breaks remaining ties, so the heap never compares requests
    request: Request = field(compare=False)


class WaitingQueue:
    """FCFS: one deque per tenant in arrival order (a preempted request goes back to the
    front of its tenant's); the next request is the head of the tenant with the fewest
    running requests, the earliest arrival among equals, so one tenant's burst cannot hold
    back another tenant's first request (with one tenant this is plain FCFS).
    Priority: a heap by (priority, arrival_time); a preempted request goes back under its own
    key, which puts it ahead of every later arrival of the same priority.

    Removal is lazy: an aborted request is marked finished by the scheduler and skipped when it
    reaches the head, so abort is O(1) even with a long queue. __len__ counts live requests.
    """

    __slots__ = ("_deques", "_heap", "_num_live", "_priority", "_seq")

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        self._deques: dict[str, deque[Request]] = {}  # tenant -> its waiting requests
        self._heap: list[_HeapEntry] = []
        self._seq = 0
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def add(self, request: Request) -> None:
        """A new arrival: the back of its tenant's line (FCFS) or its place by (priority,
        arrival_time)."""
        self._push(request, front=False)

    def add_preempted(self, request: Request) -> None:
        """A preempted request: the front of its tenant's line (FCFS) or its own key."""
        self._push(request, front=True)

    def peek(self, num_running: Callable[[str], int] = lambda _: 0) -> Request | None:
        """The next live request to admit, or None; drops aborted ones found at the heads.
        `num_running(tenant)` is asked only when more than one tenant is waiting."""
        if self._priority:
            while self._heap and self._heap[0].request.is_finished:
                heapq.heappop(self._heap)
            return self._heap[0].request if self._heap else None
        heads = self._live_heads()
        if len(heads) <= 1:
            return heads[0] if heads else None
        return min(heads, key=lambda r: (num_running(r.tenant), r.arrival_time))

    def pop(self, request: Request) -> None:
        """Remove `request`, which peek() just returned."""
        if self._priority:
            heapq.heappop(self._heap)
        else:
            line = self._deques[request.tenant]
            line.popleft()
            if not line:
                del self._deques[request.tenant]
        self._num_live -= 1

    def mark_removed(self) -> None:
        """One queued request was finished (aborted) in place; it is skipped at the head."""
        self._num_live -= 1

    def _push(self, request: Request, front: bool) -> None:
        self._num_live += 1
        if self._priority:
            self._seq += 1
            entry = _HeapEntry(request.priority, request.arrival_time, self._seq, request)
            heapq.heappush(self._heap, entry)
            return
        line = self._deques.setdefault(request.tenant, deque())
        if front:
            line.appendleft(request)
        else:
            line.append(request)

    def _live_heads(self) -> list[Request]:
        """Each tenant's first live request, after dropping finished ones (and empty lines)."""
        heads = []
        for tenant in list(self._deques):
            line = self._deques[tenant]
            while line and line[0].is_finished:
                line.popleft()
            if line:
                heads.append(line[0])
            else:
                del self._deques[tenant]
        return heads
