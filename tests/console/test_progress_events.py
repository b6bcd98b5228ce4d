"""The engine's side of the progress extension, with a fake runner: step numbers on every
output, a ChunkProgress on every event of a request that asked for it (a progress-only event
for each prefill chunk that samples nothing), and nothing extra for a request that did not."""

from __future__ import annotations

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.output import RunnerOutput, SchedulerOutput, TokenEvent
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler

TOKEN = 7  # what the fake runner samples


class Clock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def scheduler(budget: int, clock: Clock) -> tuple[Scheduler, KVCacheManager]:
    kv = KVCacheManager(num_blocks=64, block_size=4)
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget, max_model_len=512)
    return Scheduler(config, kv, clock), kv


def request(request_id: str, prompt: list[int], max_tokens: int, progress: bool) -> Request:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, report_progress=progress)
    return Request(request_id, prompt, params, arrival_time=0.0)


def step(sched: Scheduler, kv: KVCacheManager, clock: Clock):
    output = sched.schedule()
    sampled = {c.request_id: TOKEN for c in output.chunks if c.samples}
    events = sched.update(output, RunnerOutput(sampled_token_ids=sampled))
    kv.check_invariants()
    clock.now += 1.0
    return output, events


def run_to_end(sched, kv, clock) -> tuple[list[SchedulerOutput], list[TokenEvent]]:
    outputs, events = [], []
    while sched.has_unfinished_requests:
        output, new = step(sched, kv, clock)
        outputs.append(output)
        events.extend(new)
    return outputs, events


def test_a_chunked_prefill_reports_every_chunk_then_one_token_per_decode_step():
    clock = Clock()
    sched, kv = scheduler(budget=8, clock=clock)
    sched.add_request(request("a", list(range(100, 120)), max_tokens=3, progress=True))
    outputs, events = run_to_end(sched, kv, clock)

    assert [o.step_index for o in outputs] == [1, 2, 3, 4, 5]
    # 20 prompt tokens under a budget of 8: chunks 0-7, 8-15 (progress only), 16-19 samples.
    shape = [
        (e.progress.step_index, e.progress.is_decode, e.progress.start_position,
         e.progress.num_new_tokens, e.new_token_ids, e.finished)
        for e in events
    ]  # fmt: skip
    assert shape == [
        (1, False, 0, 8, [], False),
        (2, False, 8, 8, [], False),
        (3, False, 16, 4, [TOKEN], False),
        (4, True, 20, 1, [TOKEN], False),
        (5, True, 21, 1, [TOKEN], True),
    ]
    computed = [e.progress.num_prompt_tokens_computed for e in events]
    assert computed == [8, 16, 20, 20, 20]
    assert all(e.progress.num_prompt_tokens == 20 for e in events)
    assert [e.progress.computed_at for e in events] == [50.0, 51.0, 52.0, 53.0, 54.0]
    # Progress events are not final and carry no timestamps of a produced token.
    assert all(e.produced_at is None and e.times is None for e in events[:2])


def test_a_request_that_did_not_ask_gets_exactly_the_events_it_always_got():
    clock = Clock()
    sched, kv = scheduler(budget=8, clock=clock)
    sched.add_request(request("quiet", list(range(200, 220)), max_tokens=3, progress=False))
    outputs, events = run_to_end(sched, kv, clock)
    assert len(outputs) == 5
    assert [len(e.new_token_ids) for e in events] == [1, 1, 1]
    assert all(e.progress is None for e in events)


def test_requests_sharing_a_step_share_its_number_and_see_the_batch_size():
    clock = Clock()
    sched, kv = scheduler(budget=64, clock=clock)
    sched.add_request(request("a", list(range(300, 310)), max_tokens=2, progress=True))
    sched.add_request(request("b", list(range(400, 406)), max_tokens=2, progress=False))
    _, events = step(sched, kv, clock)
    by_id = {e.request_id: e for e in events}
    assert by_id["a"].progress.step_index == 1
    assert by_id["a"].progress.num_scheduled_requests == 2
    assert by_id["b"].progress is None


def test_progress_carries_a_copy_of_the_cost_so_far():
    clock = Clock()
    sched, _ = scheduler(budget=64, clock=clock)
    sched.add_request(request("a", list(range(500, 508)), max_tokens=2, progress=True))
    output = sched.schedule()
    live = sched.get_request("a")
    live.cost.prefill_seconds += 0.25  # what EngineCore._charge books before update()
    [event] = sched.update(output, RunnerOutput(sampled_token_ids={"a": TOKEN}))
    live.cost.prefill_seconds += 1.0
    assert event.progress.cost.prefill_seconds == 0.25  # a snapshot, not the live object


def test_an_empty_schedule_has_no_step_number():
    clock = Clock()
    sched, _ = scheduler(budget=8, clock=clock)
    assert sched.schedule().step_index is None
