"""--batch-invariant end to end on the served model: a seeded sampled request and a greedy one
give the same tokens and the same logprobs alone and inside mixed batches of 3, 7 and 40
requests, and after being preempted and recomputed.

The engine serves the embedded SmolLM2 Q4_1 GGUF in bfloat16 (the server's configuration) with a
small step budget, so the targets' 150-token prompt is prefilled in chunks that fall
differently in every batch, beside decodes and other prompts of every length; sampled, greedy
and seeded neighbours mix. Without the mode, on this model, the seeded request's second token
already differs inside a batch of 3 and the greedy one's logprobs in every batch (the kernels'
paths change with the row count); with it, nothing may differ.
"""

from __future__ import annotations

import random

import pytest

from engine.batch_invariance import BatchInvarianceError
from engine.config import EngineConfig
from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

STEP = {"max_num_batched_tokens": 256, "long_prefill_token_threshold": 48}
TARGETS = [
    SamplingParams(max_tokens=24, temperature=0.9, top_p=0.95, seed=7, logprobs=2, ignore_eos=True),
    SamplingParams(max_tokens=24, temperature=0.0, logprobs=2, ignore_eos=True),
]


def _llm(**overrides) -> LLM:
    try:
        return LLM(EngineConfig(dtype="bfloat16", batch_invariant=True, **STEP, **overrides))
    except BatchInvarianceError as exc:  # no native kernels or no AVX512-BF16 here
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def workload() -> tuple[list[int], list[tuple[list[int], SamplingParams]]]:
    rng = random.Random(0)

    def prompt(length: int) -> list[int]:
        return [rng.randrange(200, 40_000) for _ in range(length)]

    neighbours = []
    for _ in range(38):
        params = SamplingParams(
            max_tokens=rng.choice([4, 9, 16]),
            temperature=rng.choice([0.0, 0.7, 1.0]),
            seed=rng.choice([None, 3]),
            ignore_eos=True,
        )
        neighbours.append((prompt(rng.choice([3, 20, 60, 120])), params))
    return prompt(150), neighbours


@pytest.fixture(scope="module")
def invariant_llm() -> LLM:
    return _llm()


@pytest.fixture(scope="module")
def alone(invariant_llm: LLM, workload) -> list:
    outputs = _targets_among(invariant_llm, workload[0], [])
    assert all(len(output.token_ids) == 24 for output in outputs)
    return outputs


def _targets_among(llm: LLM, target_prompt: list[int], neighbours) -> list:
    prompts = [target_prompt, target_prompt] + [p for p, _ in neighbours]
    params = TARGETS + [s for _, s in neighbours]
    return llm.generate(prompts, params)[:2]


def _same(outputs, alone) -> None:
    for output, reference in zip(outputs, alone, strict=True):
        assert output.token_ids == reference.token_ids
        assert output.logprobs == reference.logprobs


def test_tokens_and_logprobs_do_not_depend_on_the_batch(invariant_llm, workload, alone) -> None:
    target_prompt, neighbours = workload
    for size in (3, 7, 40):
        _same(_targets_among(invariant_llm, target_prompt, neighbours[: size - 2]), alone)


def test_a_preempted_request_is_recomputed_to_the_same_tokens(workload, alone) -> None:
    target_prompt, neighbours = workload
    small = _llm(kv_cache_bytes=24 << 20)  # ~68 blocks of 16: the batch does not fit at once
    before = small.engine.num_preemptions_total
    _same(_targets_among(small, target_prompt, neighbours), alone)
    assert small.engine.num_preemptions_total > before
