"""LLM.generate on the real SmolLM2-135M equals Hugging Face `generate` greedily (float32).

16 prompts (~5 to ~300 tokens: plain text, chat, chat sharing a long system prompt) run as one
batch. Any divergence must be a near-tie (engine_equivalence.py says exactly what that means).
The same holds under preemption, prefix-cache hits and chunked prefill.
"""

from __future__ import annotations

import json

import pytest
from engine_equivalence import (
    CHAT_QUESTIONS,
    MAX_NEW_TOKENS,
    TOP,
    Reference,
    assert_equivalent,
    compare,
)
from tiny_draft import write_tiny_draft

from engine.llm import LLM, GenerationOutput
from engine.loader import ModelLoadError
from scheduler.output import TokenLogprobs
from scheduler.sampling_params import SamplingParams, StructuredOutput
from scheduler.speculative_config import SpeculativeConfig

GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=TOP)
BLOCK_SIZE = 16
# SmolLM2-135M: 30 layers x 3 KV heads x 64 dims, K and V, float32, 16 tokens per block.
FP32_BLOCK_BYTES = 2 * 30 * 3 * 64 * 4 * BLOCK_SIZE


def _llm(**overrides) -> LLM:
    config = {
        "dtype": "float32",
        "kv_cache_bytes": 200_000_000,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 64,
    }
    return LLM(**{**config, **overrides})


def _assert_clean(llm: LLM) -> None:
    engine = llm.engine
    engine.check_invariants()
    assert engine.num_running == 0 and engine.num_waiting == 0
    assert engine.num_free_blocks == engine.kv_cache_info.num_blocks


def test_prompt_set_spans_lengths(prompts) -> None:
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) >= 16
    assert lengths[0] <= 8 and lengths[-1] >= 250, lengths


def test_one_batch_greedy_equals_hf(prompts, hf_references) -> None:
    llm = _llm()
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.max_running_batch_observed == len(prompts)  # all ran side by side
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_equal_under_preemption(prompts, hf_references) -> None:
    # 40 blocks = 640 tokens: the longest request (~330 tokens) fits alone, all 16 do not.
    llm = _llm(kv_cache_bytes=40 * FP32_BLOCK_BYTES)
    assert llm.engine.kv_cache_info.num_blocks == 40
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.num_preemptions_total > 0
    print(f"preemptions: {llm.engine.num_preemptions_total}")
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_equal_with_prefix_cache_hits(prompts, hf_references) -> None:
    llm = _llm()
    first_shared = len(prompts) - len(CHAT_QUESTIONS)
    # One request with the shared system prompt runs first and leaves its full blocks cached.
    llm.generate([prompts[first_shared]], SamplingParams(max_tokens=1, temperature=0.0))
    outputs = llm.generate(prompts, GREEDY)
    assert llm.engine.kv_cache.prefix_cache_hit_tokens > 0
    print(f"prefix-cache hit tokens: {llm.engine.kv_cache.prefix_cache_hit_tokens}")
    # Every prompt with the ~150-token system prompt got at least its first blocks cached.
    for output in outputs[first_shared:]:
        assert output.num_cached_tokens >= 8 * BLOCK_SIZE, output.num_cached_tokens
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_equal_with_chunked_prefill(prompts, hf_references) -> None:
    budget = 64
    assert max(len(p) for p in prompts) > 4 * budget
    llm = _llm(max_num_batched_tokens=budget, enable_prefix_caching=False)
    outputs = llm.generate(prompts, GREEDY)
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_equal_with_speculative_decoding(prompts, hf_references) -> None:
    # Drafts from 1- to 3-token matches, up to 4 per decode, verified in the decode's pass.
    spec = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1)
    llm = _llm(speculative=spec)
    counts = _count_steps(llm)
    outputs = llm.generate(prompts, GREEDY)
    print(f"draft tokens {counts['drafts']}, accepted {counts['accepted']}")
    assert counts["accepted"] > 0 and counts["drafts"] > counts["accepted"]
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_equal_with_a_draft_model_under_preemption(prompts, hf_references) -> None:
    # The model drafting for itself: nearly every draft is accepted, and the draft's K/V,
    # kept in the target's block ids, survives preemption and prefix-cache hits or is rebuilt.
    spec = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="default")
    llm = _llm(speculative=spec, kv_cache_bytes=2 * 40 * FP32_BLOCK_BYTES)
    assert llm.engine.kv_cache_info.num_blocks == 40  # a block holds both models' K/V
    counts = _count_steps(llm)
    outputs = llm.generate(prompts, GREEDY)
    print(f"draft tokens {counts['drafts']}, accepted {counts['accepted']}, {counts}")
    assert llm.engine.num_preemptions_total > 0
    assert counts["accepted"] >= 0.9 * counts["drafts"] > 0
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_the_meter_bills_the_draft_models_passes(prompts) -> None:
    # The model drafting for itself, every draft accepted: each token runs once in the draft
    # model and once in the target, so the steps' FLOPs are twice plain decoding's (less the
    # draft's last row per pass, which needs no logits).
    spec = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="default")
    flops = []
    for llm in (_llm(), _llm(speculative=spec)):
        counts = _count_steps(llm)
        llm.generate(prompts[:6], GREEDY)
        assert llm.engine.num_preemptions_total == 0
        flops.append(counts["flops"])
    print(f"FLOPs with the draft model / without: {flops[1] / flops[0]:.3f}")
    assert 1.9 < flops[1] / flops[0] <= 2.0


def test_equal_with_a_random_draft_model(prompts, hf_references, tiny_draft_dir) -> None:
    # A draft model that agrees with nothing: only the acceptance changes, never the output.
    spec = SpeculativeConfig(
        num_speculative_tokens=3, method="draft_model", model=str(tiny_draft_dir)
    )
    llm = _llm(speculative=spec)
    counts = _count_steps(llm)
    outputs = llm.generate(prompts, GREEDY)
    print(f"draft tokens {counts['drafts']}, accepted {counts['accepted']}")
    assert counts["drafts"] > 0 and counts["accepted"] < counts["drafts"] / 4
    assert_equivalent(outputs, hf_references)
    _assert_clean(llm)


def test_a_draft_model_drafts_within_the_grammar(real_tokenizer) -> None:
    # A JSON schema: the draft model samples each draft as the request's own greedy row, its
    # grammar's mask included, so the model drafting for itself has every draft kept (without
    # the mask 52 of 88 were), and the output is that of decoding without drafts.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    params = SamplingParams(
        max_tokens=40,
        temperature=0.0,
        structured_output=StructuredOutput(kind="json_schema", spec=json.dumps(schema)),
    )
    questions = ["Describe a person as JSON.", "Give me a JSON record for Alice, who is 30."]
    prompts = [
        real_tokenizer.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False
        )
        for q in questions
    ]
    spec = SpeculativeConfig(num_speculative_tokens=4, method="draft_model", model="default")
    llm = _llm(speculative=spec)
    counts = _count_steps(llm)
    drafted = llm.generate(prompts, params)
    plain = _llm().generate(prompts, params)
    print(f"draft tokens {counts['drafts']}, accepted {counts['accepted']}")
    assert counts["accepted"] == counts["drafts"] > 10
    assert [o.token_ids for o in drafted] == [o.token_ids for o in plain]
    assert all(json.loads(o.text)["age"] >= 0 for o in drafted)
    _assert_clean(llm)
    # The draft's grammar matchers are dropped as the target's are: at the next step.
    llm.generate(prompts[:1], SamplingParams(max_tokens=1))
    assert not llm.engine.draft_model.runner.structured.matchers


@pytest.mark.parametrize(
    ("variant", "message"),
    [
        ({"extra_token": "<draft-only>"}, "different vocabulary"),
        ({"max_positions": 1024}, "--max-model-len 1024"),
    ],
)
def test_a_draft_model_that_cannot_serve_is_refused_naming_why(
    real_model_dir, tmp_path, variant, message
) -> None:
    draft = write_tiny_draft(real_model_dir, tmp_path / "draft", **variant)
    spec = SpeculativeConfig(num_speculative_tokens=2, method="draft_model", model=str(draft))
    with pytest.raises(ModelLoadError, match=message):
        _llm(speculative=spec)


def _count_steps(llm: LLM) -> dict[str, float]:
    """Counts the engine's steps' drafts, accepted drafts and metered FLOPs from now on."""
    counts = {"drafts": 0, "accepted": 0, "flops": 0.0}
    step = llm.engine.step

    def counting_step():
        result = step()
        if result.stats is not None:
            counts["drafts"] += result.stats.num_draft_tokens
            counts["accepted"] += result.stats.num_accepted_draft_tokens
            counts["flops"] += result.stats.prefill_flops + result.stats.decode_flops
        return result

    llm.engine.step = counting_step
    return counts


def test_bfloat16_smoke(prompts, hf_references) -> None:
    # bfloat16 keeps ~3 significant digits, so long greedy continuations drift from float32
    # HF at its first close call. What must hold: every request finishes normally with tokens,
    # and for at least 3/4 of the prompts the first 4 tokens equal HF float32's exactly.
    llm = _llm(dtype="bfloat16")
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    assert all(o.finish_reason in ("stop", "length") and o.token_ids for o in outputs)
    agree = [o.token_ids[:4] == r.token_ids[:4] for o, r in zip(outputs, hf_references)]
    print(f"bf16: first 4 tokens equal HF fp32 for {sum(agree)}/{len(agree)} prompts")
    assert sum(agree) >= 0.75 * len(agree), agree
    _assert_clean(llm)


# -- the comparison itself (no model): it accepts near-ties and rejects real differences ----


def _fake_output(token_ids, top) -> GenerationOutput:
    logprobs = [
        TokenLogprobs(
            t, dict(candidates)[t], [c for c, _ in candidates], [v for _, v in candidates]
        )
        for t, candidates in zip(token_ids, top, strict=True)
    ]
    return GenerationOutput("r", [1], token_ids, logprobs, finish_reason="length")


def _fake_reference(token_ids, top) -> Reference:
    return Reference(
        token_ids,
        [dict(candidates)[t] for t, candidates in zip(token_ids, top, strict=True)],
        [[c for c, _ in candidates] for candidates in top],
        [[v for _, v in candidates] for candidates in top],
    )


CLEAR = [(5, -0.1), (6, -3.0)]
TIE_OURS = [(7, -0.6900), (8, -0.6905)]
TIE_HF = [(8, -0.6901), (7, -0.6904)]


def test_compare_accepts_equal_and_near_tie() -> None:
    ref = _fake_reference([5, 8, 9], [CLEAR, TIE_HF, [(9, -0.2)]])
    assert compare(0, _fake_output([5, 8, 9], [CLEAR, TIE_HF, [(9, -0.2)]]), ref, True).equal
    tie = compare(0, _fake_output([5, 7, 3], [CLEAR, TIE_OURS, [(3, -0.1)]]), ref, True)
    assert tie.diverged_at == 1 and not tie.problems and not tie.equal


def test_compare_rejects_real_differences() -> None:
    ref = _fake_reference([5, 8], [CLEAR, TIE_HF])
    wide = compare(0, _fake_output([5, 7], [CLEAR, [(7, -0.1), (8, -2.5)]]), ref, True)
    assert wide.problems and "not a near-tie" in wide.problems[0]
    absent = compare(0, _fake_output([5, 4], [CLEAR, [(4, -0.1), (3, -2.5)]]), ref, True)
    assert absent.problems and "top-5" in absent.problems[0]
    drift = compare(0, _fake_output([5, 8], [[(5, -0.2), (6, -3.0)], TIE_HF]), ref, True)
    assert drift.problems and "logprob differs" in drift.problems[0]
    short = compare(0, _fake_output([5], [CLEAR]), ref, True)
    assert short.problems and "lengths differ" in short.problems[0]
