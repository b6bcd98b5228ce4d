"""A model step that raises fails only the request that caused it.

EngineConfig.debug_fault_token_id = X makes the runner raise whenever a step's chunks contain
token X. A request carrying X must end with finish_reason "error" and a message; the requests
batched with it must finish normally with exactly the tokens they produce without it, and the
block pool must be whole again at the end. Prefix caching is off so that both runs compute
every token the same way.
"""

from __future__ import annotations

import pytest

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
GOOD_TEXTS = [
    "The capital of Italy is",
    "Water is made of hydrogen and",
    "My favourite season is autumn because",
]
BAD_TEXT = "Zebras graze quietly on the savanna near"


def _llm(fault_token_id: int | None) -> LLM:
    return LLM(
        dtype="float32",
        kv_cache_bytes=50_000_000,
        enable_prefix_caching=False,
        debug_fault_token_id=fault_token_id,
    )


def _assert_pool_whole(llm: LLM) -> None:
    engine = llm.engine
    engine.check_invariants()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.num_free_blocks == engine.kv_cache_info.num_blocks


@pytest.fixture(scope="module")
def good_prompts(real_tokenizer) -> list[list[int]]:
    return [real_tokenizer.encode(text, add_special_tokens=False) for text in GOOD_TEXTS]


def _unused_token(candidates: list[int], used: set[int]) -> int:
    for token_id in candidates:
        if token_id not in used:
            return token_id
    raise AssertionError("no candidate token is absent from the other requests")


def test_fault_in_prefill_fails_only_that_request(real_tokenizer, good_prompts) -> None:
    bad_prompt = real_tokenizer.encode(BAD_TEXT, add_special_tokens=False)
    # Any id of the bad prompt that no good prompt contains; good outputs are checked below.
    fault = _unused_token(bad_prompt, {t for p in good_prompts for t in p})
    llm = _llm(fault)
    baseline = llm.generate(good_prompts, PARAMS)
    assert all(o.finish_reason == "length" for o in baseline)
    assert all(fault not in o.token_ids for o in baseline)
    _assert_pool_whole(llm)

    mixed = [good_prompts[0], bad_prompt, good_prompts[1], good_prompts[2]]
    outputs = llm.generate(mixed, PARAMS)
    bad = outputs[1]
    assert bad.finish_reason == "error"
    assert bad.token_ids == []
    assert bad.error and "injected fault" in bad.error
    good = [outputs[0], outputs[2], outputs[3]]
    assert [o.finish_reason for o in good] == ["length"] * 3
    assert [o.token_ids for o in good] == [o.token_ids for o in baseline]
    assert all(o.error is None for o in good)
    _assert_pool_whole(llm)


def test_fault_while_decoding_fails_only_that_request(good_prompts) -> None:
    # Learn what the requests generate, then arm the fault on a token the second request
    # produces mid-way (and nobody else sees): it fails on the step after sampling it.
    baseline = _llm(fault_token_id=None).generate(good_prompts, PARAMS)
    others = {t for p in good_prompts for t in p}
    others |= {t for i, o in enumerate(baseline) if i != 1 for t in o.token_ids}
    victim = baseline[1].token_ids
    index = next(i for i in range(3, len(victim) - 1) if victim[i] not in others | set(victim[:i]))
    llm = _llm(victim[index])
    outputs = llm.generate(good_prompts, PARAMS)
    assert outputs[1].finish_reason == "error" and "injected fault" in outputs[1].error
    # The fault token itself was delivered; the step after it failed.
    assert outputs[1].token_ids == victim[: index + 1]
    for i in (0, 2):
        assert outputs[i].finish_reason == "length"
        assert outputs[i].token_ids == baseline[i].token_ids
    _assert_pool_whole(llm)
