"""RunningList: the running requests in policy order, and preemption from its tail.

Scheduler rule 1 orders it (fcfs: admission order; priority: (priority, arrival_time)); each
step serves it from the head, so the tail is what rule 4 preempts when the KV cache cannot
grow a request: the most recently admitted (fcfs) or the least important (priority). A
preempted request drops its blocks, restarts from position 0 and goes back to the waiting
queue (WaitingQueue.add_preempted).
"""

from __future__ import annotations

import bisect
import enum

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.request import Request, RequestStatus
from scheduler.waiting_queue import WaitingQueue


class Fit(enum.Enum):
    """How RunningList.allocate_or_preempt() ended for the request it grew."""

    FITS = enum.auto()  # its blocks are allocated
    PREEMPTED = enum.auto()  # it was the tail itself, and was preempted
    ALONE = enum.auto()  # it alone was left running and still does not fit (rule 8)


class RunningList:
    """Owns the running requests' order and the count of preemptions.

    Guarantees: every request in it is RUNNING, in rule 1's order; a preempted request is
    PREEMPTED, holds no blocks and is in the waiting queue.
    """

    def __init__(self, policy: str, kv_cache: KVCacheManager, waiting: WaitingQueue) -> None:
        self._priority = policy == "priority"
        self._kv_cache = kv_cache
        self._waiting = waiting
        self._requests: list[Request] = []
        self.num_preemptions_total = 0

    def __len__(self) -> int:
        return len(self._requests)

    def __getitem__(self, index: int) -> Request:
        return self._requests[index]

    def add(self, request: Request) -> None:
        """An admitted request, at its place in rule 1's order."""
        if self._priority:
            bisect.insort(self._requests, request, key=_priority_key)
        else:
            self._requests.append(request)

    def remove(self, request: Request) -> None:
        self._requests.remove(request)

    def drop_finished(self) -> None:
        self._requests = [request for request in self._requests if not request.is_finished]

    def num_of_tenant(self, tenant: str) -> int:
        return sum(1 for request in self._requests if request.tenant == tenant)

    def decodes_behind(self) -> list[int]:
        """decodes_behind[i]: running requests after position i with one token to compute.
        Preemption only shortens the list from the tail, so the counts stay upper bounds."""
        counts = [0] * len(self._requests)
        behind = 0
        for i in range(len(self._requests) - 1, -1, -1):
            counts[i] = behind
            request = self._requests[i]
            behind += request.num_tokens - request.num_computed_tokens == 1
        return counts

    def allocate_or_preempt(self, request: Request, num_tokens: int, preempted: list[str]) -> Fit:
        """Rule 4: preempt from the tail until `request` fits, appending the victims' ids to
        `preempted`. Victims are never already scheduled this step: the tail lies at or after
        the request being scheduled. ALONE empties the list; the caller fails the request.
        Rule 9: the chunk starts at num_computed_tokens."""
        start = request.num_computed_tokens
        while not self._kv_cache.allocate_slots(
            request.request_id, num_tokens, num_computed_tokens=start
        ):
            if len(self._requests) == 1:
                self._requests.clear()
                return Fit.ALONE
            victim = self._requests.pop()
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return Fit.PREEMPTED
        return Fit.FITS

    def _preempt(self, request: Request) -> None:
        self._kv_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self._waiting.add_preempted(request)


def _priority_key(request: Request) -> tuple[int, float]:
    return (request.priority, request.arrival_time)
