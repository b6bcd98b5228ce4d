"""Scheduler with a fake runner: who ran, with how many tokens, who was preempted, how each
request ended; the KV cache's invariants are checked after every schedule and update."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from kvcache.kv_cache_manager import KVCacheManager
from kvcache.window import max_live_blocks
from scheduler.config import SchedulerConfig
from scheduler.output import RunnerOutput, SchedulerOutput, TokenEvent, TokenLogprobs
from scheduler.request import FINISH_REASONS, Request, RequestStatus
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

EOS = 2
FILLER = 7  # what the fake runner samples unless a script says otherwise
_prompt_bases = itertools.count(1)  # distinct prompts: no accidental prefix-cache hits


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Harness:
    """A scheduler over a real KVCacheManager, driven step by step by a fake runner that
    samples FILLER, or what `script(request_id, output_index)` returns."""

    sched: Scheduler
    kv: KVCacheManager
    clock: FakeClock
    script: Callable[[str, int], int] | None = None

    def step(self) -> tuple[SchedulerOutput, list[TokenEvent]]:
        out = self.sched.schedule()
        self.kv.check_invariants()
        events = self.sched.update(out, self.run(out))
        self.kv.check_invariants()
        self.clock.now += 1.0
        return out, events

    def run(self, out: SchedulerOutput) -> RunnerOutput:
        sampled = {}
        for chunk in out.chunks:
            if chunk.samples:
                index = len(chunk.output_token_ids)
                script = self.script
                sampled[chunk.request_id] = script(chunk.request_id, index) if script else FILLER
        return RunnerOutput(sampled_token_ids=sampled)

    def add(self, request_id: str, num_prompt: int, **kwargs: Any) -> Request:
        request = make_request(request_id, num_prompt, arrival=self.clock.now, **kwargs)
        self.sched.add_request(request)
        self.clock.now += 0.001
        return request


def make_request(
    request_id: str,
    num_prompt: int,
    arrival: float = 0.0,
    priority: int = 0,
    tokens: list[int] | None = None,
    cache_salt: str = "",
    tenant: str = "",
    **params: object,
) -> Request:
    base = 1_000_000 * next(_prompt_bases)
    prompt = tokens if tokens is not None else [base + i for i in range(num_prompt)]
    params.setdefault("max_tokens", 100)
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        arrival_time=arrival,
        eos_token_ids=frozenset({EOS}),
        priority=priority,
        cache_salt=cache_salt,
        tenant=tenant,
    )


def harness(
    num_blocks: int = 64,
    block_size: int = 4,
    caching: bool = True,
    sliding_window: int | None = None,
    **config: object,
) -> Harness:
    kv = KVCacheManager(num_blocks, block_size, caching, sliding_window)
    clock = FakeClock()
    return Harness(Scheduler(SchedulerConfig(**config), kv, clock), kv, clock)  # type: ignore[arg-type]


def ran(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    """(request_id, num_new_tokens, start_position, samples) of each chunk, in output order."""
    return [(c.request_id, c.num_new_tokens, c.start_position, c.samples) for c in out.chunks]


def assert_all_blocks_free(h: Harness) -> None:
    assert h.kv.num_free_blocks == h.kv.num_usable_blocks  # all but a null block
    h.kv.check_invariants()


# ------------------------------------------------------------------------------ basic flow


def test_prefill_then_decodes_until_max_tokens() -> None:
    h = harness()
    request = h.add("A", 10, max_tokens=3)
    out, events = h.step()
    assert ran(out) == [("A", 10, 0, True)]
    chunk = out.chunks[0]
    assert chunk.token_ids == request.prompt_token_ids and chunk.block_table == [0, 1, 2]
    assert not chunk.is_decode and out.num_running == 1 and out.num_waiting == 0
    assert [(e.new_token_ids, e.finish_reason) for e in events] == [([FILLER], None)]
    out, events = h.step()
    assert ran(out) == [("A", 1, 10, True)] and out.chunks[0].is_decode
    assert out.chunks[0].token_ids == [FILLER]
    out, events = h.step()
    assert ran(out) == [("A", 1, 11, True)]
    [event] = events
    assert event.finish_reason == "length" and event.num_output_tokens == 3
    assert request.status == RequestStatus.FINISHED_LENGTH
    assert request.output_token_ids == [FILLER] * 3
    assert_all_blocks_free(h)
    out, events = h.step()
    assert out.is_empty and out.finished_request_ids == ["A"] and events == []
    assert not h.sched.has_unfinished_requests


def test_chunked_prefill_mixed_with_decodes() -> None:
    h = harness(max_num_batched_tokens=8)
    h.add("A", 4)
    h.add("B", 20)
    out, _ = h.step()
    assert ran(out) == [("A", 4, 0, True), ("B", 4, 0, False)]
    out, _ = h.step()
    assert ran(out) == [("A", 1, 4, True), ("B", 7, 4, False)]  # decode first, then chunk
    out, _ = h.step()
    assert ran(out) == [("A", 1, 5, True), ("B", 7, 11, False)]
    out, events = h.step()
    assert ran(out) == [("A", 1, 6, True), ("B", 2, 18, True)]
    assert [e.request_id for e in events] == ["A", "B"]  # only sampling chunks get events
    out, _ = h.step()
    assert ran(out) == [("A", 1, 7, True), ("B", 1, 20, True)]
    assert out.num_batched_tokens == 2 and out.num_decode_tokens == 2


def test_a_tenants_burst_does_not_hold_back_another_tenants_first_request() -> None:
    """Rule 6 under fcfs: each tenant has its own line; the head admitted is the tenant's
    with the fewest running requests, so alice's request, arriving behind four of mallory's,
    is admitted at the next step and mallory's next prompt takes what is left."""
    h = harness(max_num_batched_tokens=12)
    for i in range(5):
        h.add(f"M{i}", 10, tenant="mallory", max_tokens=1)
    out, _ = h.step()
    assert ran(out) == [("M0", 10, 0, True), ("M1", 2, 0, False)]
    h.add("A", 4, tenant="alice", max_tokens=3)
    out, _ = h.step()  # M0 finished; M1 (running) first, then alice's before M2
    assert ran(out) == [("M1", 8, 2, True), ("A", 4, 0, True)]
    out, _ = h.step()
    assert ran(out) == [("A", 1, 4, True), ("M2", 10, 0, True), ("M3", 1, 0, False)]


def test_one_tenant_is_plain_fcfs_and_preempted_requests_keep_the_front() -> None:
    h = harness(max_num_batched_tokens=4)
    for name in ("X", "Y", "Z"):
        h.add(name, 4, tenant="t", max_tokens=1)
    assert [ran(h.step()[0])[0][0] for _ in range(3)] == ["X", "Y", "Z"]


def test_a_prefill_chunk_leaves_every_later_decode_its_token() -> None:
    """Rule 3: B (alice) decodes behind P, a long prompt still prefilling; P's chunk is cut
    so that B gets its token every step, and to the long-prefill threshold."""
    h = harness(max_num_batched_tokens=8, long_prefill_token_threshold=6)
    h.add("B", 2, tenant="alice", max_tokens=50)
    out, _ = h.step()
    assert ran(out) == [("B", 2, 0, True)]
    h.add("P", 40, tenant="mallory", max_tokens=1)
    out, _ = h.step()  # admitted, its chunk cut to the threshold (6 of the 7 left)
    assert ran(out) == [("B", 1, 2, True), ("P", 6, 0, False)]
    h.add("C", 2, tenant="carol", max_tokens=50)
    out, _ = h.step()  # C admitted with the 1 token P's threshold leaves
    assert ran(out) == [("B", 1, 3, True), ("P", 6, 6, False), ("C", 1, 0, False)]
    out, _ = h.step()  # P is ahead of C in the running list: it leaves C's token for it
    assert ran(out) == [("B", 1, 4, True), ("P", 6, 12, False), ("C", 1, 1, True)]
    out, _ = h.step()  # decodes come first in the output
    assert ran(out) == [("B", 1, 5, True), ("C", 1, 2, True), ("P", 6, 18, False)]


def test_no_chunking_admits_only_whole_prompts_head_of_line() -> None:
    h = harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("A", 4, max_tokens=2)
    h.add("B", 8)
    h.add("C", 1)
    out, _ = h.step()
    assert ran(out) == [("A", 4, 0, True)]  # B (8) does not fit in 4; C may not overtake it
    out, _ = h.step()
    assert ran(out) == [("A", 1, 4, True)]
    out, _ = h.step()
    assert ran(out) == [("B", 8, 0, True)]
    out, _ = h.step()
    assert ran(out) == [("B", 1, 8, True), ("C", 1, 0, True)]


def test_max_num_seqs_caps_the_running_batch() -> None:
    h = harness(max_num_seqs=2)
    for name in "ABC":
        h.add(name, 3, max_tokens=2)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["A", "B"]
    assert out.num_running == 2 and out.num_waiting == 1
    out, _ = h.step()  # A and B finish here
    assert [c.request_id for c in out.chunks] == ["A", "B"]
    out, _ = h.step()
    assert ran(out) == [("C", 3, 0, True)] and sorted(out.finished_request_ids) == ["A", "B"]


# ------------------------------------------------------------------------------ preemption


def test_preempts_most_recently_admitted_and_recomputes_it() -> None:
    h = harness(num_blocks=4, block_size=4)
    a = h.add("A", 4, max_tokens=4)
    b = h.add("B", 4, max_tokens=4)
    c = h.add("C", 4, max_tokens=4)
    out, _ = h.step()
    assert ran(out) == [("A", 4, 0, True), ("B", 4, 0, True), ("C", 4, 0, True)]
    # Each needs a second block now; one is free: A takes it, B forces C (latest) out.
    out, _ = h.step()
    assert ran(out) == [("A", 1, 4, True), ("B", 1, 4, True)]
    assert out.preempted_request_ids == ["C"] and out.num_preemptions == 1
    assert c.status == RequestStatus.PREEMPTED and c.num_computed_tokens == 0
    assert c.num_preemptions == 1 and h.sched.num_preemptions_total == 1
    assert h.kv.block_table("A") == [0, 3] and h.kv.block_table("B") == [1, 2]
    assert out.num_waiting == 1 and out.num_running == 2
    out, _ = h.step()  # C cannot get 2 blocks yet
    assert ran(out) == [("A", 1, 5, True), ("B", 1, 5, True)] and out.num_waiting == 1
    out, _ = h.step()
    assert ran(out) == [("A", 1, 6, True), ("B", 1, 6, True)]
    assert a.is_finished and b.is_finished
    out, _ = h.step()
    # C recomputes its prompt and its one output token, then samples its second token.
    assert ran(out) == [("C", 5, 0, True)]
    assert out.chunks[0].token_ids == c.prompt_token_ids + [FILLER]
    assert c.status == RequestStatus.RUNNING and c.num_output_tokens == 2
    assert h.sched.num_preemptions_total == 1


def test_request_may_preempt_itself() -> None:
    h = harness(num_blocks=2, block_size=4)
    h.add("A", 3)
    b = h.add("B", 4)
    h.step()
    out, _ = h.step()  # A still fits its block; B needs a second one and is the tail itself
    assert ran(out) == [("A", 1, 3, True)]
    assert out.preempted_request_ids == ["B"] and b.status == RequestStatus.PREEMPTED
    assert h.kv.block_table("B") == []


def test_preempted_request_gets_its_cached_prefix_back() -> None:
    h = harness(num_blocks=5, block_size=4)
    h.add("A", 8, max_tokens=2)  # blocks 0, 1 (+ 4 when decoding)
    c = h.add("C", 8, max_tokens=3)  # blocks 2, 3
    h.step()
    out, _ = h.step()  # A takes block 4; C needs one more, none left: C preempts itself
    assert out.preempted_request_ids == ["C"] and ran(out) == [("A", 1, 8, True)]
    assert h.kv.pool.free_queue.block_ids() == [3, 2, 4, 1, 0]  # A finished too
    out, _ = h.step()  # C comes back: 8 of its 9 tokens are still cached
    assert ran(out) == [("C", 1, 8, True)]
    assert out.prefix_cache_hit_tokens == 8 and out.prefix_cache_queried_tokens == 9
    assert h.kv.block_table("C") == [2, 3, 4]
    assert c.num_cached_tokens == 0  # recorded at first admission only


# ------------------------------------------------------------------------------ prefix cache


def test_prefix_hit_counts_as_computed() -> None:
    h = harness(block_size=4)
    shared = list(range(500, 510))
    h.add("A", 0, tokens=shared, max_tokens=1)
    out, _ = h.step()
    assert out.prefix_cache_queried_tokens == 10 and out.prefix_cache_hit_tokens == 0
    b = h.add("B", 0, tokens=shared[:8] + [1, 2, 3], max_tokens=2)
    out, events = h.step()
    assert ran(out) == [("B", 3, 8, True)]
    assert out.chunks[0].token_ids == [1, 2, 3] and out.chunks[0].block_table[:2] == [0, 1]
    assert out.prefix_cache_queried_tokens == 11 and out.prefix_cache_hit_tokens == 8
    assert b.num_cached_tokens == 8 and events[0].num_cached_tokens == 8
    out, events = h.step()
    assert out.prefix_cache_queried_tokens == 0 and events[0].num_cached_tokens == 8


def test_prefix_hits_stay_within_a_cache_salt() -> None:
    """A tenant's salt: B (another salt) computes the whole shared prefix and is told 0
    cached tokens; C (A's salt) hits A's blocks."""
    h = harness(block_size=4)
    shared = list(range(600, 610))
    h.add("A", 0, tokens=shared, max_tokens=1, cache_salt="tenant-a")
    h.step()
    b = h.add("B", 0, tokens=shared[:8] + [1, 2, 3], max_tokens=1, cache_salt="tenant-b")
    out, events = h.step()
    assert ran(out) == [("B", 11, 0, True)] and out.prefix_cache_hit_tokens == 0
    assert b.num_cached_tokens == 0 and events[0].num_cached_tokens == 0
    c = h.add("C", 0, tokens=shared[:8] + [1, 2, 3], max_tokens=1, cache_salt="tenant-a")
    out, events = h.step()
    assert ran(out) == [("C", 3, 8, True)] and c.num_cached_tokens == 8


def test_caching_disabled_computes_everything() -> None:
    h = harness(caching=False)
    h.add("A", 10, max_tokens=1)
    h.step()
    h.add("B", 10, max_tokens=1)
    out, _ = h.step()
    assert ran(out) == [("B", 10, 0, True)] and out.prefix_cache_queried_tokens == 0


# ------------------------------------------------------------------------------ aborts


def test_abort_waiting_request() -> None:
    h = harness(max_num_seqs=1)
    h.add("A", 4)
    h.add("B", 4)
    h.step()
    event = h.sched.abort_request("B")
    assert event is not None and event.finish_reason == "abort" and event.new_token_ids == []
    assert event.times is not None and event.times.finished is not None
    assert h.sched.num_waiting == 0 and h.sched.get_request("B") is None
    assert h.sched.abort_request("B") is None
    out, _ = h.step()
    assert out.finished_request_ids == ["B"] and ran(out) == [("A", 1, 4, True)]


def test_abort_at_every_stage_frees_every_block() -> None:
    h = harness(num_blocks=4, block_size=4, max_num_batched_tokens=6)
    h.add("P", 4)  # running decode
    h.add("Q", 10)  # mid-prefill after step 1
    h.add("W", 2)  # waiting: the budget is spent
    out, _ = h.step()
    assert ran(out) == [("P", 4, 0, True), ("Q", 2, 0, False)]
    out, _ = h.step()
    assert ran(out) == [("P", 1, 4, True), ("Q", 5, 2, False)]
    out, _ = h.step()  # Q needs a third block: P took one, W none left; Q preempts itself
    assert out.preempted_request_ids == ["Q"]
    q = h.sched.get_request("Q")
    assert q is not None and q.status == RequestStatus.PREEMPTED
    for name in ("Q", "W"):  # preempted, waiting
        event = h.sched.abort_request(name)
        assert event is not None and event.finish_reason == "abort"
        h.kv.check_invariants()
    out = h.sched.schedule()  # P scheduled, then aborted before update()
    assert ran(out) == [("P", 1, 6, True)] and out.finished_request_ids == ["Q", "W"]
    event = h.sched.abort_request("P", RequestStatus.FINISHED_ERROR, "runner crashed")
    assert event is not None and event.finish_reason == "error" and event.error == "runner crashed"
    assert h.sched.update(out, h.run(out)) == []  # skipped safely
    assert_all_blocks_free(h)
    assert not h.sched.has_unfinished_requests
    out, _ = h.step()
    assert out.finished_request_ids == ["P"]


def test_fail_requests_and_abort_validation() -> None:
    h = harness()
    h.add("A", 4)
    h.add("B", 4)
    h.step()
    events = h.sched.fail_requests(["A", "nobody", "B"], "device lost")
    assert [(e.request_id, e.finish_reason, e.error) for e in events] == [
        ("A", "error", "device lost"),
        ("B", "error", "device lost"),
    ]
    assert_all_blocks_free(h)
    with pytest.raises(ValueError, match="not a finished status"):
        h.sched.abort_request("A", RequestStatus.RUNNING)


# ------------------------------------------------------------------------------ stopping


def finish_of(h: Harness, request_id: str, max_steps: int = 50) -> TokenEvent:
    for _ in range(max_steps):
        _, events = h.step()
        for event in events:
            if event.request_id == request_id and event.finished:
                return event
    raise AssertionError(f"{request_id} did not finish")


def eos_at(index: int) -> Callable[[str, int], int]:
    return lambda _request_id, i: EOS if i >= index else FILLER


def test_eos_stops() -> None:
    h = harness()
    h.script = eos_at(2)
    request = h.add("A", 4)
    event = finish_of(h, "A")
    assert event.finish_reason == "stop" and event.new_token_ids == [EOS]
    assert request.output_token_ids == [FILLER, FILLER, EOS]
    assert request.status == RequestStatus.FINISHED_STOPPED


def test_eos_ignored_before_min_tokens() -> None:
    h = harness()
    h.script = eos_at(0)
    request = h.add("A", 4, min_tokens=3)
    event = finish_of(h, "A")
    assert event.finish_reason == "stop" and request.num_output_tokens == 3


def test_ignore_eos_runs_to_max_tokens() -> None:
    h = harness()
    h.script = eos_at(0)
    request = h.add("A", 4, ignore_eos=True, max_tokens=5)
    event = finish_of(h, "A")
    assert event.finish_reason == "length" and request.output_token_ids == [EOS] * 5


def test_stop_token_ids_stop() -> None:
    h = harness()
    h.script = lambda _rid, i: 40 + i
    request = h.add("A", 4, stop_token_ids=(42,))
    event = finish_of(h, "A")
    assert event.finish_reason == "stop" and request.output_token_ids == [40, 41, 42]


def test_max_model_len_stops() -> None:
    h = harness(max_model_len=8)
    request = h.add("A", 5)
    event = finish_of(h, "A")
    assert event.finish_reason == "length" and request.num_tokens == 8
    assert event.num_prompt_tokens == 5 and event.num_output_tokens == 3


def test_every_finished_status_has_a_finish_reason() -> None:
    finished = [status for status in RequestStatus if status.is_finished]
    assert sorted(FINISH_REASONS) == finished
    assert set(FINISH_REASONS.values()) == {"stop", "length", "abort", "error"}
    assert not any(status.is_finished for status in RequestStatus if status not in finished)


# ------------------------------------------------------------------------------ policy


def test_priority_policy_orders_admission() -> None:
    h = harness(policy="priority", max_num_seqs=1)
    h.add("low", 2, priority=5, max_tokens=1)
    h.add("high_late", 2, priority=0, max_tokens=1)
    h.add("mid", 2, priority=1, max_tokens=1)
    h.add("high_later", 2, priority=0, max_tokens=1)
    order = []
    for _ in range(4):
        out, _ = h.step()
        order += [c.request_id for c in out.chunks]
    assert order == ["high_late", "high_later", "mid", "low"]


def test_priority_policy_preempts_least_important() -> None:
    h = harness(num_blocks=3, block_size=4, policy="priority")
    important = h.add("important", 4, priority=0)
    background = h.add("background", 4, priority=9)
    h.add("normal", 4, priority=1)
    out, _ = h.step()
    assert [c.request_id for c in out.chunks] == ["important", "normal", "background"]
    # All three need a second block and none is free. The least important goes first (not
    # the latest admitted); then "normal", now the tail, preempts itself.
    out, _ = h.step()
    assert ran(out) == [("important", 1, 4, True)]
    assert out.preempted_request_ids == ["background", "normal"]
    assert important.status == RequestStatus.RUNNING
    assert background.status == RequestStatus.PREEMPTED


def test_fcfs_preempted_requests_return_in_admission_order() -> None:
    h = harness(num_blocks=3, block_size=4)
    h.add("A", 4, max_tokens=2)
    h.add("B", 4)
    h.add("C", 4)
    h.step()
    out, _ = h.step()  # A needs a block, none free: C goes; B, now the tail, preempts itself
    assert ran(out) == [("A", 1, 4, True)] and out.preempted_request_ids == ["C", "B"]
    out, _ = h.step()  # A finished; B (admitted before C) returns first, C waits for blocks
    assert ran(out) == [("B", 1, 4, True)] and out.num_waiting == 1
    assert out.prefix_cache_hit_tokens == 4  # B's own prompt block was still cached


# ------------------------------------------------------------------------------ robustness


def test_prompt_larger_than_the_pool_fails_instead_of_livelocking() -> None:
    h = harness(num_blocks=4, block_size=4, max_num_batched_tokens=8)
    h.add("big", 20)
    h.add("small", 3, max_tokens=1)
    events: list[TokenEvent] = []
    for _ in range(6):
        _, step_events = h.step()
        events += step_events
    finished = {e.request_id: e for e in events if e.finished}
    assert finished["big"].finish_reason == "error"
    assert "holds only 4 blocks of 4 tokens" in (finished["big"].error or "")
    assert finished["small"].finish_reason == "length"
    assert_all_blocks_free(h)
    assert not h.sched.has_unfinished_requests


def test_unfittable_waiting_request_fails_in_one_step() -> None:
    h = harness(num_blocks=2, block_size=4, max_num_batched_tokens=64)
    h.add("big", 9)
    out, events = h.step()
    assert out.is_empty
    assert [(e.request_id, e.finish_reason) for e in events] == [("big", "error")]
    assert_all_blocks_free(h)


def test_unchunked_prompt_over_budget_fails() -> None:
    h = harness(max_num_batched_tokens=8, enable_chunked_prefill=False)
    h.add("long", 9)
    h.add("ok", 8, max_tokens=1)
    out, events = h.step()
    assert ran(out) == [("ok", 8, 0, True)]
    assert [(e.request_id, e.finish_reason) for e in events] == [
        ("long", "error"),
        ("ok", "length"),
    ]
    assert "max_num_batched_tokens is 8" in (events[0].error or "")


def test_runner_without_a_token_fails_the_request() -> None:
    h = harness()
    h.add("A", 4)
    out = h.sched.schedule()
    [event] = h.sched.update(out, RunnerOutput())
    assert event.finish_reason == "error" and "no token" in (event.error or "")
    assert_all_blocks_free(h)


def test_add_request_rejects_bad_requests() -> None:
    h = harness(max_model_len=8)
    h.add("A", 4)
    with pytest.raises(ValueError, match="duplicate"):
        h.add("A", 4)
    with pytest.raises(ValueError, match="empty prompt"):
        h.sched.add_request(make_request("E", 0))
    with pytest.raises(ValueError, match="no room"):
        h.sched.add_request(make_request("L", 8))


# ------------------------------------------------------------------------------ meter data


def test_times_and_logprobs_on_events() -> None:
    h = harness()
    request = h.add("A", 4, max_tokens=2)
    arrival = request.times.arrival
    out = h.sched.schedule()
    logprob = TokenLogprobs(token_id=FILLER, logprob=-0.5)
    runner = RunnerOutput(sampled_token_ids={"A": FILLER}, logprobs={"A": logprob})
    h.clock.now = 200.0
    [first] = h.sched.update(out, runner)
    assert first.logprobs == [logprob]
    assert first.produced_at == 200.0 and first.previous_token_at is None
    assert request.times.first_scheduled == arrival + 0.001
    h.clock.now = 201.5
    out = h.sched.schedule()
    [last] = h.sched.update(out, h.run(out))
    assert last.produced_at == 201.5 and last.previous_token_at == 200.0 and last.logprobs == []
    assert last.times is request.times and last.cost is request.cost
    assert (last.times.first_token, last.times.last_token, last.times.finished) == (
        200.0,
        201.5,
        201.5,
    )


# ------------------------------------------------------------------------------ stress


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("window", [None, 8])
def test_random_workload_always_drains(policy: str, chunked: bool, window: int | None) -> None:
    """A tiny pool, shared prefixes, random aborts: every request ends, within a bounded number
    of steps, and the pool is whole again. Invariants are checked after every call. Under a
    sliding window no request ever holds more than the window's bound of blocks."""
    rng = random.Random(1234)
    h = harness(
        num_blocks=12,
        block_size=4,
        sliding_window=window,
        max_num_batched_tokens=16,
        max_num_seqs=5,
        policy=policy,
        enable_chunked_prefill=chunked,
    )
    h.script = lambda _rid, _i: EOS if rng.random() < 0.05 else FILLER
    prefixes = [[rng.randrange(3, 50) for _ in range(8)] for _ in range(3)]
    num_requests, ended = 40, set()
    for i in range(num_requests):
        tail = [rng.randrange(3, 50) for _ in range(rng.randrange(1, 9))]
        tokens = rng.choice(prefixes)[: rng.randrange(0, 9)] + tail
        h.add(
            f"r{i}",
            0,
            tokens=tokens,
            priority=rng.randrange(3),
            max_tokens=rng.randrange(1, 20),
            tenant=rng.choice(["t0", "t1", "t2"]),
        )
    for _ in range(1000):
        if not h.sched.has_unfinished_requests:
            break
        if rng.random() < 0.05:
            victim = f"r{rng.randrange(num_requests)}"
            event = h.sched.abort_request(victim)
            h.kv.check_invariants()
            if event is not None:
                ended.add(victim)
        out, events = h.step()
        ended.update(e.request_id for e in events if e.finished)
        assert h.sched.num_running <= 5
        if window is not None:
            bound = max_live_blocks(window, 16, 4)
            assert all(live_blocks(chunk.block_table) <= bound for chunk in out.chunks)
    assert ended == {f"r{i}" for i in range(num_requests)}
    assert_all_blocks_free(h)
    # The workload did exercise preemption and prefix hits (and the window's freeing).
    assert h.sched.num_preemptions_total > 0 and h.kv.prefix_cache_hit_tokens > 0
    assert (h.kv.num_window_freed_blocks > 0) == (window is not None)


# ---------------------------------------------------------------------------- sliding window
# Window 8, blocks of 4 (rule 9): a chunk at s frees blocks i < (s - 7) // 4 first; their
# table entries become the null block 0, which the pool never hands out.


def live_blocks(table: list[int]) -> int:
    return sum(1 for block_id in table if block_id != 0)


def test_window_runs_a_request_longer_than_the_pool_in_bounded_blocks() -> None:
    h = harness(num_blocks=6, block_size=4, sliding_window=8, max_num_batched_tokens=8)
    request = h.add("A", 30, max_tokens=20)  # 50 tokens; the pool holds 5 * 4 = 20
    bound = max_live_blocks(8, 8, 4)
    assert bound == 5
    outs, min_free = [], h.kv.num_blocks
    while h.sched.has_unfinished_requests:
        out, _ = h.step()
        outs.append(out)
        min_free = min(min_free, h.kv.num_free_blocks)
        for chunk in out.chunks:
            assert live_blocks(chunk.block_table) <= bound
    assert [ran(out)[0][1:3] for out in outs[:5]] == [(8, 0), (8, 8), (8, 16), (6, 24), (1, 30)]
    assert [out.chunks[0].block_table for out in outs[:3]] == [
        [1, 2],
        [1, 2, 3, 4],
        [0, 0, 3, 4, 5, 2],
    ]
    # The chunk at 16 freed blocks 1 and 2 (positions 0..7) and took block 2 back at once.
    assert outs[2].num_window_freed_blocks == 2
    assert outs[3].chunks[0].block_table == [0, 0, 0, 0, 5, 2, 1, 4]  # positions 16..29
    assert outs[-1].chunks[0].block_table == [0] * 10 + [2, 1, 4]  # the decode at 48
    assert min_free == 1
    assert sum(out.num_window_freed_blocks for out in outs) == 13 - 3  # all but the last 3
    assert request.finish_reason == "length" and request.num_output_tokens == 20
    assert_all_blocks_free(h)
    assert h.kv.num_free_blocks == 5  # the null block stays reserved


def test_without_a_window_the_same_request_cannot_fit() -> None:
    h = harness(num_blocks=5, block_size=4, max_num_batched_tokens=8)
    h.add("A", 30, max_tokens=20)
    finish = finish_of(h, "A")
    assert finish.finish_reason == "error"
    assert "holds only 5 blocks of 4 tokens" in (finish.error or "")


def test_window_request_whose_chunk_never_fits_fails_with_the_window_in_the_error() -> None:
    h = harness(num_blocks=4, block_size=4, sliding_window=8, max_num_batched_tokens=16)
    h.add("big", 30)
    out, events = h.step()
    assert out.is_empty and [e.finish_reason for e in events] == ["error"]
    assert events[0].error == (
        "request needs 4 KV blocks at once for positions 0..15 (sliding window of 8 tokens) "
        "but the cache holds only 3 blocks of 4 tokens"
    )
    assert_all_blocks_free(h)


def test_window_preemption_frees_everything_and_recomputes() -> None:
    h = harness(num_blocks=5, block_size=4, sliding_window=8, max_num_batched_tokens=16)
    a = h.add("A", 10, max_tokens=14)
    b = h.add("B", 6, max_tokens=14)
    steps = [h.step()[0] for _ in range(4)]
    assert [ran(out) for out in steps] == [
        [("A", 10, 0, True)],
        [("A", 1, 10, True)],  # B waits: its 6 tokens need 2 blocks, 1 is free
        [("A", 1, 11, True), ("B", 6, 0, True)],  # A's decode at 11 freed block 1 for B
        [("A", 1, 12, True)],
    ]
    assert steps[2].chunks[0].block_table == [0, 2, 3] and h.kv.block_table("A") == [0, 2, 3, 1]
    assert steps[2].chunks[1].block_table == [4, 1]
    # At 12 A needs a 4th block: B, the tail, is preempted and drops all its blocks.
    assert steps[3].preempted_request_ids == ["B"] and h.kv.block_table("B") == []
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    while h.sched.has_unfinished_requests:
        h.step()
    assert a.finish_reason == b.finish_reason == "length"
    assert a.num_output_tokens == b.num_output_tokens == 14
    assert a.num_preemptions == 0 and b.num_preemptions == 3
    assert_all_blocks_free(h)


def test_window_requests_share_a_prefix() -> None:
    h = harness(num_blocks=10, block_size=4, sliding_window=8, max_num_batched_tokens=8)
    prefix = list(range(500, 516))
    h.add("A", 0, tokens=prefix + [1, 2, 3, 4], max_tokens=3)
    for _ in range(3):
        h.step()
    assert h.kv.block_table("A") == [0, 0, 3, 4, 5]  # blocks 1, 2 freed, still cached
    b = h.add("B", 0, tokens=prefix + [9, 9, 9], max_tokens=3)
    out, _ = h.step()
    assert ran(out) == [("A", 1, 20, True), ("B", 3, 16, True)]
    # B's hit is A's 4 blocks; at 16 it sees positions 9.. only: it takes blocks 3 and 4.
    assert out.prefix_cache_hit_tokens == 16 and b.num_cached_tokens == 16
    assert out.chunks[1].block_table == [0, 0, 3, 4, 7]
    assert h.kv.block_table("A") == [0, 0, 0, 4, 5, 6]  # A's decode at 20 dropped block 3
    assert [h.kv.pool.blocks[i].ref_count for i in (1, 2, 3, 4)] == [0, 0, 1, 2]
    while h.sched.has_unfinished_requests:
        h.step()
    assert_all_blocks_free(h)
