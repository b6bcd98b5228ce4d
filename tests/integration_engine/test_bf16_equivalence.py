"""The served configuration against Hugging Face, both in bfloat16, greedily, 64 new tokens.

Ours: the embedded SmolLM2-135M-Instruct Q4_1 GGUF loaded by the engine as the server loads it,
the default EngineConfig with dtype bfloat16: packed bf16 matmuls (AMX, or oneDNN without it),
decode matvecs of <= 4 rows on the file's Q4_1/Q8_0 blocks, the native kernels, plain greedy
sampling (native argmax), prefix caching. HF: `generate` on the same weights (the loader's
float conversion) cast to bfloat16, all 16 prompts in one left-padded batch with its KV cache
(engine_equivalence.hf_greedy_batch: a sixth of the time of one prompt at a time).

The 16 prompts (engine_equivalence.build_prompts: plain text and chat, 4 to 280 tokens) arrive
in three waves, so every matmul regime serves decode: 2 concurrent requests (the GGUF blocks'
exact weights, through the native decode stack), 5 (the GGUF blocks dequantized to bf16 per
block) and 9 (the packed bf16 weights). Prefill runs on the packed weights (a wave's prompts
are one batch of more than 8 rows); the later waves hit the prefix cache for the shared system
prompt.

bf16 greedy decoding is not reproducible across implementations, so the test does not ask for
equal sequences. It asks that a sequence leaves HF's path only where HF itself nearly chose our
token: at the first position where the tokens differ, HF's log-probability of its own token
exceeds that of ours by less than NEAR_TIE_NATS (the reasoning is at the constant). Tokens
before that position are equal by definition; the rest of the sequence is not compared (both
continue from different prefixes). Two floors then check that such divergences stay rare.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest
import torch
from engine_equivalence import hf_greedy_batch

from engine.config import EngineConfig
from engine.llm import LLM, GenerationOutput
from scheduler.sampling_params import SamplingParams
from scheduler.speculative_config import SpeculativeConfig

MAX_NEW_TOKENS = 64
# Waves of concurrent requests (prompt indices), run in this order, growing. Decode batches of
# <= 8 rows read the GGUF blocks in the decode stack (kernels' MAX_SMALL_BATCH_ROWS), exactly
# up to 4 rows; 9 rows take the packed bf16 weights (on an AMX CPU the stack's GGUF tiles,
# which take 5-32 rows; prompts of more than 32 tokens take the bf16 weights there).
WAVES = ((1, 9), (3, 7, 11, 13, 15), (0, 2, 4, 5, 6, 8, 10, 12, 14))

# Why 0.75 nats. HF's logits are bf16 values. This model's top logits reach 44 (measured; 2 to
# 30 at this test's divergences), where bf16's spacing (ulp) is up to 0.25 (0.125 below 32). A
# gap is HF's logit of its token minus HF's logit of ours, while our logits order the two the
# other way, so it is at most how much the two implementations disagree on the difference of
# two logits: rounding the two output logits costs each side up to one ulp of that difference,
# and the rest is the accumulated difference of two valid computations (other summation orders
# in 576- and 1536-wide dot products and attention, the GGUF matvecs multiplying the exact
# dequantized weights where HF multiplies them rounded to bf16, a 30-layer residual stream
# rounded to bf16 after every add). Measured on this machine (no AMX), over the positions before
# the first divergence: the top-1 minus top-2 difference disagrees by up to 0.50 between HF's
# own sdpa and eager attention (p99 0.375) and by up to 0.49 between HF bf16 and float32; our
# gaps at the divergences are 0 to 0.25 (~0.31 when the 16 requests run one at a time). 0.75 is
# 1.5x the largest disagreement between two HF runs, 3 ulps at the largest logits, and still
# catches real bugs. Injected into our engine (and not kept): RoPE base 10000 instead of the
# config's 100000 gave gaps up to 1.25 (and 1 of 16 sequences equal); Q4_1 weights off by one
# quantization step gave gaps of 17 to 30 nats. A bug that moves logits by much less than bf16's
# own noise (attention scale off by 2% gave gaps <= 0.25) is out of reach of any bf16 greedy
# comparison; the float32 tests (test_hf_equivalence.py) hold the model code to 1e-3.
NEAR_TIE_NATS = 0.75
# The floors. On HF's own path, 15 of the 16 prompts have at least one position in 64 tokens
# where its top two logits are within 0.25, most of them several: an implementation that is not
# bit-identical to HF flips some of them, so "most sequences equal" is not what bf16 promises.
# Measured between valid implementations, sequences equal through 64 tokens: ours vs HF bf16 5
# or 6 of 16 (all 16 requests at once, waves of 4, one at a time, these waves), HF sdpa vs
# eager 10, HF bf16 vs float32 3; tokens before the first divergence: ours vs HF bf16 51-60%, HF
# bf16 vs float32 45%, HF sdpa vs eager 74%. With the RoPE-base bug: 1 equal, 15%. HF batched
# against HF one prompt at a time: 5 equal. Ours against the batched references (an AMX Xeon):
# 8 equal, 61% matched, gaps <= 0.19.
MIN_EQUAL_SEQUENCES = 3
MIN_MATCHED_FRACTION = 1 / 3


@dataclass(slots=True)
class HFBf16Reference:
    """HF's greedy tokens and, per generated position, its logits (bf16 values, kept exactly)."""

    token_ids: list[int]
    logits: torch.Tensor = field(repr=False)  # [len(token_ids), vocab] bfloat16


@dataclass(slots=True)
class Divergence:
    """Where one of our sequences first leaves HF's, and how close HF was to choosing ours."""

    index: int
    position: int | None  # None: equal through the end
    ours: int | None = None
    hf: int | None = None
    hf_logprob_hf: float = 0.0  # HF's log-probabilities of its own token and of ours
    hf_logprob_ours: float = float("-inf")
    hf_top_logit: float = 0.0

    @property
    def gap(self) -> float:
        """>= 0 (HF chose its token greedily); inf where the lengths differ with no token."""
        return 0.0 if self.position is None else self.hf_logprob_hf - self.hf_logprob_ours


# The served configuration, and the same with n-gram speculative decoding: a decode's drafts
# are verified as extra decode rows, so its tokens come from the same kernels' regimes.
SPECULATIVE = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.fixture(scope="module", params=[None, SPECULATIVE], ids=["plain", "ngram"])
def served_outputs(request, prompts) -> list[GenerationOutput]:
    llm = LLM(EngineConfig(dtype="bfloat16", speculative=request.param))
    runner = llm.engine.runner
    assert runner.dtype == torch.bfloat16
    if runner.kernels is not None:
        # Every linear layer and the (tied) LM head serve small batches from GGUF blocks.
        assert runner.num_gguf_matvec_layers == 4 * runner.shape.num_layers + 1
    print(
        f"\nserved: kernels {runner.kernels is not None}, "
        f"AMX {runner.kernels is not None and runner.kernels.amx_available()}, "
        f"GGUF matvec layers {runner.num_gguf_matvec_layers}"
    )
    greedy = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
    outputs: list[GenerationOutput | None] = [None] * len(prompts)
    start = time.perf_counter()
    for wave in WAVES:
        for index, output in zip(wave, llm.generate([prompts[i] for i in wave], greedy)):
            outputs[index] = output
        # The wave ran side by side (waves only grow, so the running max is this wave's size):
        # its decode took the regime it stands for.
        assert llm.engine.max_running_batch_observed == len(wave)
    assert all(output is not None for output in outputs)
    print(
        f"ours: {time.perf_counter() - start:.1f} s, "
        f"prefix-cache hit tokens {llm.engine.kv_cache.prefix_cache_hit_tokens}"
    )
    llm.engine.check_invariants()
    return outputs


@pytest.fixture(scope="module")
def hf_bf16_references(real_model_dir, real_tokenizer, prompts) -> list[HFBf16Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.bfloat16).eval()
    eos = real_tokenizer.eos_token_id
    # One thread, as the float32 fixture: OpenMP spin-waits on shared cores (2 threads took
    # 660 s instead of 40 s here when the prompts ran one at a time).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            refs = [
                HFBf16Reference(token_ids, logits)
                for token_ids, logits in hf_greedy_batch(model, prompts, MAX_NEW_TOKENS, eos)
            ]
    finally:
        torch.set_num_threads(threads)
    print(f"HF bf16: {time.perf_counter() - start:.1f} s")
    return refs


def first_divergence(index: int, ours: list[int], ref: HFBf16Reference) -> Divergence:
    for position, (a, b) in enumerate(zip(ours, ref.token_ids)):
        if a != b:
            logits = ref.logits[position].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            return Divergence(
                index, position, a, b, float(logprobs[b]), float(logprobs[a]), float(logits.max())
            )
    # Equal over the shorter one: both stopped at the same EOS or both ran to the limit, or
    # one stopped where the other did not (a difference with no token to compare: a failure).
    if len(ours) != len(ref.token_ids):
        return Divergence(index, min(len(ours), len(ref.token_ids)))
    return Divergence(index, None)


def test_served_bf16_greedy_leaves_hf_bf16_only_at_near_ties(
    prompts, served_outputs, hf_bf16_references, real_tokenizer
) -> None:
    assert all(o.finish_reason in ("stop", "length") for o in served_outputs)
    results = [
        first_divergence(i, o.token_ids, ref)
        for i, (o, ref) in enumerate(zip(served_outputs, hf_bf16_references, strict=True))
    ]
    _print_table(prompts, results, real_tokenizer)
    far = [r for r in results if r.position is not None and not r.gap < NEAR_TIE_NATS]
    assert not far, "not near-ties:\n" + "\n".join(_describe(r, real_tokenizer) for r in far)
    equal = sum(r.position is None for r in results)
    total = sum(len(ref.token_ids) for ref in hf_bf16_references)
    matched = sum(
        len(ref.token_ids) if r.position is None else r.position
        for r, ref in zip(results, hf_bf16_references, strict=True)
    )
    print(f"equal through the end: {equal}/{len(results)}; matched tokens {matched}/{total}")
    assert equal >= MIN_EQUAL_SEQUENCES, f"only {equal} sequences equal HF's through the end"
    assert matched >= MIN_MATCHED_FRACTION * total, f"{matched}/{total} before divergences"


def _print_table(prompts, results: list[Divergence], tokenizer) -> None:
    concurrency = {i: len(wave) for wave in WAVES for i in wave}
    print("prompt  tokens  wave  first divergence  gap (nats)  HF top logit  ours / HF token")
    for r in results:
        if r.position is None:
            print(f"{r.index:6d}  {len(prompts[r.index]):6d}  {concurrency[r.index]:4d}  {'-':>16}")
            continue
        tokens = f"{_token(r.ours, tokenizer)} / {_token(r.hf, tokenizer)}"
        print(
            f"{r.index:6d}  {len(prompts[r.index]):6d}  {concurrency[r.index]:4d}  "
            f"{r.position:16d}  {r.gap:10.4f}  {r.hf_top_logit:12.3f}  {tokens}"
        )


def _describe(r: Divergence, tokenizer) -> str:
    if r.ours is None:
        return f"prompt {r.index}: lengths differ at {r.position} with every token equal"
    return (
        f"prompt {r.index}, position {r.position}: ours {r.ours} {_token(r.ours, tokenizer)}, "
        f"HF {r.hf} {_token(r.hf, tokenizer)}; HF logprobs: its token {r.hf_logprob_hf:.4f}, "
        f"ours {r.hf_logprob_ours:.4f}, gap {r.gap:.4f} >= {NEAR_TIE_NATS}"
    )


def _token(token_id: int | None, tokenizer) -> str:
    return "-" if token_id is None else repr(tokenizer.decode([token_id]))
