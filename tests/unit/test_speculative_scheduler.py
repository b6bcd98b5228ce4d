"""Speculative decoding in the scheduler (rule 10): drafts scheduled with decodes under the
budget, accepted drafts become tokens and computed positions, the rest is dropped; with a
fake runner that agrees with a scripted number of drafts."""

from __future__ import annotations

from kvcache.kv_cache_manager import KVCacheManager
from scheduler.config import SchedulerConfig
from scheduler.drafting import DRAFT_SLOT
from scheduler.output import RunnerOutput, SchedulerOutput, TokenLogprobs
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams, StructuredOutput
from scheduler.scheduler import Scheduler
from scheduler.speculative_config import SpeculativeConfig

EOS = 2
# A prompt that repeats itself: after "... 10 11 12" the n-gram [11, 12] proposes 13 14 15.
LOOP = [10, 11, 12, 13, 14, 15, 16, 17]
PROMPT = LOOP + LOOP[:3]


def make_scheduler(
    k: int = 3, num_blocks: int = 64, lookup_min: int = 2, **config: object
) -> Scheduler:
    spec = SpeculativeConfig(
        num_speculative_tokens=k, prompt_lookup_max=2, prompt_lookup_min=lookup_min
    )
    kv = KVCacheManager(num_blocks, 4, True)
    return Scheduler(SchedulerConfig(speculative=spec, **config), kv)  # type: ignore[arg-type]


def add(sched: Scheduler, request_id: str, prompt: list[int], **params: object) -> Request:
    params.setdefault("max_tokens", 50)
    request = Request(
        request_id,
        list(prompt),
        SamplingParams(**params),
        0.0,
        frozenset({EOS}),  # type: ignore[arg-type]
    )
    sched.add_request(request)
    return request


def agree(out: SchedulerOutput, num_accepted: dict[str, int], sampled: int = 99) -> RunnerOutput:
    """The fake verification: keep num_accepted[id] drafts (all by default), then `sampled`."""
    result = RunnerOutput()
    for chunk in out.chunks:
        if not chunk.samples:
            continue
        kept = chunk.draft_token_ids[: num_accepted.get(chunk.request_id, chunk.num_draft_tokens)]
        result.sampled_token_ids[chunk.request_id] = sampled
        if chunk.draft_token_ids:
            result.accepted_draft_token_ids[chunk.request_id] = kept
    return result


def prefill(sched: Scheduler, first_token: int) -> None:
    out = sched.schedule()
    sched.update(out, agree(out, {}, sampled=first_token))


def test_a_decode_carries_the_drafts_and_accepted_ones_become_computed_tokens() -> None:
    sched = make_scheduler(k=3)
    request = add(sched, "a", PROMPT)
    prefill(sched, first_token=13)  # tokens end ... 12 13: the suffix [12, 13] proposes 14 15 16
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.token_ids == [13, 14, 15, 16] and chunk.draft_token_ids == [14, 15, 16]
    assert chunk.is_decode and chunk.num_sample_rows == 4 and chunk.start_position == 11
    assert out.num_draft_tokens == 3 and out.num_decode_tokens == 1
    (event,) = sched.update(out, agree(out, {"a": 2}))  # 14 15 kept, 16 rejected, 99 sampled
    assert event.new_token_ids == [14, 15, 99]
    assert request.output_token_ids == [13, 14, 15, 99]
    # Positions of 13, 14, 15 hold their K/V; 99 is the next token to compute.
    assert request.num_computed_tokens == request.num_tokens - 1 == 14
    sched.kv_cache.check_invariants()


def test_rejecting_every_draft_still_emits_the_sampled_token() -> None:
    sched = make_scheduler(k=3)
    request = add(sched, "a", PROMPT)
    prefill(sched, first_token=13)
    out = sched.schedule()
    (event,) = sched.update(out, agree(out, {"a": 0}, sampled=50))
    assert event.new_token_ids == [50]
    assert request.num_computed_tokens == request.num_tokens - 1


def test_drafts_are_clipped_to_max_tokens_and_stop_at_eos() -> None:
    sched = make_scheduler(k=3)
    add(sched, "a", PROMPT, max_tokens=3)
    prefill(sched, first_token=13)
    out = sched.schedule()
    # 1 output so far; 2 more allowed: one draft, then the sampled token.
    assert out.chunks[0].draft_token_ids == [14]
    (event,) = sched.update(out, agree(out, {}))
    assert event.new_token_ids == [14, 99] and event.finish_reason == "length"


def test_an_accepted_eos_ends_the_request_and_drops_the_drafts_after_it() -> None:
    loop = [10, 11, 12, EOS, 14, 15, 16, 17]
    sched = make_scheduler(k=3)
    add(sched, "a", loop + loop[:2])  # ... 10 11 -> first token 12; drafts EOS 14 15
    prefill(sched, first_token=12)
    out = sched.schedule()
    assert out.chunks[0].draft_token_ids == [EOS, 14, 15]
    (event,) = sched.update(out, agree(out, {}))
    assert event.new_token_ids == [EOS] and event.finish_reason == "stop"
    assert sched.kv_cache.num_free_blocks == sched.kv_cache.num_usable_blocks
    sched.kv_cache.check_invariants()


def test_drafts_leave_each_decode_behind_its_token_within_the_budget() -> None:
    sched = make_scheduler(k=8, lookup_min=1, max_num_batched_tokens=10)
    add(sched, "a", list(range(13, 21)))  # 8 tokens; with first token 13, [13] proposes 14..
    add(sched, "b", [30])
    add(sched, "c", [40])
    out = sched.schedule()  # all three prompts fill the budget of 10
    sched.update(out, agree(out, {}, sampled=13))
    out = sched.schedule()
    by_id = {c.request_id: c for c in out.chunks}
    # 10 - a's own token - one token for each of b and c = 7 drafts (8 proposed).
    assert by_id["a"].draft_token_ids == list(range(14, 21))
    assert out.num_batched_tokens == 10
    assert [c.request_id for c in out.chunks] == ["b", "c", "a"]  # plain decodes first


def test_draft_step_rows_gives_each_running_request_an_even_share() -> None:
    sched = make_scheduler(k=8, draft_step_rows=8)
    for i in range(3):
        add(sched, f"r{i}", PROMPT)
    prefill(sched, 13)
    out = sched.schedule()
    # 8 rows // 3 requests = 2 rows each: its token and 2 - 1 = 1 draft (8 proposed).
    assert [len(c.draft_token_ids) for c in out.chunks] == [1, 1, 1]
    assert out.num_batched_tokens == 6
    sched.update(out, agree(out, {}))
    alone = make_scheduler(k=8, draft_step_rows=8)
    add(alone, "a", PROMPT)
    prefill(alone, 13)
    # Alone: 8 - 1 = 7 drafts, one short of k; five requests on 8 rows (1 row each): none.
    assert [len(c.draft_token_ids) for c in alone.schedule().chunks] == [7]
    crowded = make_scheduler(k=8, draft_step_rows=8)
    for i in range(5):
        add(crowded, f"r{i}", PROMPT)
    prefill(crowded, 13)
    assert [c.draft_token_ids for c in crowded.schedule().chunks] == [[]] * 5


def test_structured_outputs_draft_too_and_no_match_drafts_nothing() -> None:
    sched = make_scheduler(k=3)
    add(sched, "a", PROMPT, structured_output=StructuredOutput("json_object"))
    add(sched, "b", [1, 3, 4, 5])
    prefill(sched, first_token=13)
    out = sched.schedule()
    assert {c.request_id: c.draft_token_ids for c in out.chunks} == {"a": [14, 15, 16], "b": []}


def test_drafts_are_dropped_rather_than_preempting_when_blocks_run_out() -> None:
    # 3 blocks of 4 tokens: the decode at position 11 fills the last slot; drafts need more.
    sched = make_scheduler(k=3, num_blocks=3)
    request = add(sched, "a", PROMPT, max_tokens=4)
    prefill(sched, first_token=13)
    out = sched.schedule()
    assert out.chunks[0].draft_token_ids == [] and not out.preempted_request_ids
    sched.update(out, agree(out, {}))
    assert request.num_output_tokens == 2


def test_logprobs_of_accepted_drafts_come_before_the_sampled_tokens() -> None:
    sched = make_scheduler(k=2)
    add(sched, "a", PROMPT, logprobs=0)
    prefill(sched, first_token=13)
    out = sched.schedule()
    result = agree(out, {"a": 1})
    result.accepted_logprobs["a"] = [TokenLogprobs(14, -0.1)]
    result.logprobs["a"] = TokenLogprobs(99, -2.0)
    (event,) = sched.update(out, result)
    assert event.new_token_ids == [14, 99]
    assert [entry.token_id for entry in event.logprobs] == [14, 99]


def test_all_drafts_rejected_pauses_drafting_1_then_2_decodes_and_acceptance_resets_it() -> None:
    # PROMPT loops, so every decode finds drafts; the fake runner rejects them all.
    sched = make_scheduler(k=2)
    request = add(sched, "a", PROMPT * 3)
    prefill(sched, first_token=13)

    def decode(num_accepted: int) -> list[int]:
        out = sched.schedule()
        sampled = request.token_ids[-8] if num_accepted == 0 else 99  # keep the loop going
        sched.update(out, agree(out, {"a": num_accepted}, sampled=sampled))
        return out.chunks[0].draft_token_ids

    drafted = [bool(decode(0)) for _ in range(6)]
    # drafted, rejected -> skip 1; drafted, rejected -> skip 2; drafted ...
    assert drafted == [True, False, True, False, False, True]
    assert sched.num_draft_backoffs_total == 3
    assert request.draft_backoff.length == 4 and request.draft_backoff.left == 4
    request.draft_backoff.left = 0
    assert decode(1)  # drafts again; one accepted ends the backoff
    assert request.draft_backoff.length == 0


def test_backoff_doubles_up_to_its_bound_and_zero_never_backs_off() -> None:
    from scheduler.draft_backoff import DraftBackoff

    backoff = DraftBackoff()
    lengths = []
    for _ in range(6):
        backoff.record(3, 0, max_backoff_steps=8)
        lengths.append(backoff.left)
        while backoff.skips():
            pass
    assert lengths == [1, 2, 4, 8, 8, 8]
    assert not backoff.record(0, 0, 8)  # a decode without drafts changes nothing
    never = DraftBackoff()
    assert not never.record(3, 0, max_backoff_steps=0) and not never.skips()


def test_with_a_draft_model_every_decode_reserves_its_slots_within_the_limits() -> None:
    spec = SpeculativeConfig(num_speculative_tokens=3, method="draft_model", model="/d")
    sched = Scheduler(SchedulerConfig(speculative=spec), KVCacheManager(64, 4, True))
    request = add(sched, "a", [5, 6, 7], max_tokens=6)  # no n-gram anywhere: slots all the same
    prefill(sched, first_token=8)
    out = sched.schedule()
    (chunk,) = out.chunks
    assert chunk.draft_token_ids == [DRAFT_SLOT] * 3 and chunk.token_ids == [8] + [DRAFT_SLOT] * 3
    # The KV slots of the token and its three drafts are allocated: positions 3..6.
    assert len(chunk.block_table) * 4 >= 7
    chunk.draft_token_ids[:] = chunk.token_ids[1:] = [9, 10, 11]  # what the draft model fills
    sched.update(out, agree(out, {"a": 3}, sampled=12))
    assert request.output_token_ids == [8, 9, 10, 11, 12]
    (chunk,) = sched.schedule().chunks  # one token left under max_tokens: no slot
    assert chunk.draft_token_ids == []
