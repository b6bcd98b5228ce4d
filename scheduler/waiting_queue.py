"""WaitingQueue: requests not yet running, in the order the policy admits them."""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from scheduler.request import Request


@dataclass(order=True, slots=True)
class _HeapEntry:
    priority: int
    arrival_time: float
    seq: int  # insertion order breaks remaining ties, so the heap never compares requests
    request: Request = field(compare=False)


class WaitingQueue:
    """FCFS: a deque in arrival order; a preempted request goes back to the front.
    Priority: a heap by (priority, arrival_time); a preempted request goes back under its own
    key, which puts it ahead of every later arrival of the same priority.

    Removal is lazy: an aborted request is marked finished by the scheduler and skipped when it
    reaches the head, so abort is O(1) even with a long queue. __len__ counts live requests.
    """

    __slots__ = ("_deque", "_heap", "_num_live", "_priority", "_seq")

    def __init__(self, policy: str) -> None:
        self._priority = policy == "priority"
        self._deque: deque[Request] = deque()
        self._heap: list[_HeapEntry] = []
        self._seq = 0
        self._num_live = 0

    def __len__(self) -> int:
        return self._num_live

    def add(self, request: Request) -> None:
        """A new arrival: the back (FCFS) or its place by (priority, arrival_time)."""
        self._push(request, front=False)

    def add_preempted(self, request: Request) -> None:
        """A preempted request: the front (FCFS) or its own key (priority)."""
        self._push(request, front=True)

    def peek(self) -> Request | None:
        """The next live request to admit, or None; drops aborted ones found at the head."""
        self._drop_finished_head()
        if self._priority:
            return self._heap[0].request if self._heap else None
        return self._deque[0] if self._deque else None

    def pop(self) -> Request:
        """Remove and return the request peek() returned."""
        self._drop_finished_head()
        request = heapq.heappop(self._heap).request if self._priority else self._deque.popleft()
        self._num_live -= 1
        return request

    def mark_removed(self) -> None:
        """One queued request was finished (aborted) in place; it is skipped at the head."""
        self._num_live -= 1

    def _push(self, request: Request, front: bool) -> None:
        self._num_live += 1
        if self._priority:
            self._seq += 1
            entry = _HeapEntry(request.priority, request.arrival_time, self._seq, request)
            heapq.heappush(self._heap, entry)
        elif front:
            self._deque.appendleft(request)
        else:
            self._deque.append(request)

    def _drop_finished_head(self) -> None:
        if self._priority:
            while self._heap and self._heap[0].request.is_finished:
                heapq.heappop(self._heap)
        else:
            while self._deque and self._deque[0].is_finished:
                self._deque.popleft()
