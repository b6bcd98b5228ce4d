"""The native sampling kernels (kernels/csrc/sampling.cpp, sampling/native.py) against the plain
definition in sampling/reference.py.

The kernels compute probabilities with their own exp and summation order, so a draw may differ
from the reference only when its uniform lands within rounding of a boundary between two
tokens' cumulative masses: those draws are skipped (and counted, so the check cannot pass by
skipping); every other draw must pick the reference's token.
"""

from __future__ import annotations

import random

import pytest
import torch
from sampling_chunks import sampling_chunk

from engine.kernels import load_cpu_kernels
from engine.sampler import Sampler, sample_rows
from engine.sampling.native import choose_native
from engine.sampling.reference import (
    reference_draw,
    reference_logits,
    reference_probs,
    reference_sample,
)
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="native CPU kernels not available")
DTYPES = [torch.float32, torch.bfloat16]
BOUNDARY = 3e-6  # relative to the total mass: above the fp32 rounding of these cumsums


def _logits(seed: int, rows: int, vocab: int, dtype) -> torch.Tensor:
    """Rows from flat to peaked; bf16 rounding makes many exact ties."""
    generator = torch.Generator().manual_seed(seed)
    scale = torch.tensor([0.05, 1.0, 3.0, 8.0]).repeat(rows)[:rows, None]
    return (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)


def _near_boundary(probs: torch.Tensor, uniform: float) -> bool:
    cdf = probs.to(torch.float64).cumsum(0)
    target = uniform * float(cdf[-1])
    return bool(((cdf - target).abs() <= BOUNDARY * float(cdf[-1])).any())


def _check_draws(logits, rows, params, uniforms, chosen) -> int:
    """Assert every draw away from a boundary equals the reference's; return how many were."""
    compared = 0
    for i, row in enumerate(rows):
        probs = reference_probs(logits[row].to(torch.float32), params[i])
        u = float(uniforms[i])
        if _near_boundary(probs, u):
            continue
        assert int(chosen[i]) == reference_draw(probs, u), (i, params[i])
        compared += 1
    return compared


@pytest.mark.parametrize("dtype", DTYPES)
def test_top_candidates_are_a_stable_descending_sort_after_temperature(dtype) -> None:
    logits = _logits(1, 6, 3000, dtype)
    rows = torch.tensor([5, 0, 3, 1])
    temperature = torch.tensor([0.7, 1.0, 1.3, 0.2])
    row_max, total, values, ids = kernels.top_candidates(logits, rows, temperature, 64)
    for i, row in enumerate(rows.tolist()):
        x = logits[row].to(torch.float32) / temperature[i]
        expected, order = x.sort(descending=True, stable=True)
        assert torch.equal(values[i], expected[:64]), i
        assert torch.equal(ids[i], order[:64]), i
        assert float(row_max[i]) == float(x.max())
        torch.testing.assert_close(total[i], torch.exp(x - x.max()).sum(), rtol=2e-6, atol=0)


def test_top_candidates_pad_rows_with_fewer_finite_logits() -> None:
    logits = torch.full((1, 500), float("-inf"))
    allowed = torch.tensor([3, 77, 200, 499])
    logits[0, allowed] = torch.tensor([1.0, 2.0, 2.0, -1.0])
    row_max, total, values, ids = kernels.top_candidates(
        logits, torch.tensor([0]), torch.tensor([1.0]), 8
    )
    assert ids[0, :4].tolist() == [77, 200, 3, 499]
    assert values[0, :4].tolist() == [2.0, 2.0, 1.0, -1.0]
    assert torch.isinf(values[0, 4:]).all() and float(row_max[0]) == 2.0
    torch.testing.assert_close(total[0], torch.exp(logits[0] - 2.0).sum())


@pytest.mark.parametrize("dtype", DTYPES)
def test_whole_vocabulary_draws_match_the_reference(dtype) -> None:
    vocab = 4000
    logits = _logits(2, 8, vocab, dtype)
    logits[:, :50] = float("-inf")  # banned tokens must never come out
    params = [
        SamplingParams(temperature=[0.5, 1.0, 1.7, 0.9][i % 4], min_p=[0.0, 0.0, 0.05, 0.2][i % 4])
        for i in range(8)
    ]
    generator = torch.Generator().manual_seed(3)
    compared = 0
    for _ in range(40):
        uniforms = torch.rand(8, dtype=torch.float64, generator=generator)
        rows = list(range(8))
        chosen = choose_native(logits, rows, params, uniforms, kernels)
        assert bool((chosen >= 50).all())
        compared += _check_draws(logits, rows, params, uniforms, chosen)
    assert compared >= 0.9 * 40 * 8


@pytest.mark.parametrize("dtype", DTYPES)
def test_truncated_draws_match_the_reference(dtype) -> None:
    vocab = 6000
    logits = _logits(4, 12, vocab, dtype)
    settings = [
        {"top_p": 0.95},
        {"top_p": 0.5, "temperature": 0.7},
        {"top_k": 40},
        {"top_k": 5, "top_p": 0.8},
        {"top_p": 0.9, "min_p": 0.05},
        {"top_k": 300, "temperature": 1.5},
    ]
    params = [SamplingParams(**{"temperature": 1.0, **settings[i % 6]}) for i in range(12)]
    generator = torch.Generator().manual_seed(5)
    compared = 0
    for _ in range(30):
        uniforms = torch.rand(12, dtype=torch.float64, generator=generator)
        rows = list(range(11, -1, -1))  # any row order
        row_params = [params[r] for r in rows]
        chosen = choose_native(logits, rows, row_params, uniforms, kernels)
        compared += _check_draws(logits, rows, row_params, uniforms, chosen)
    assert compared >= 0.9 * 30 * 12


def test_a_nucleus_beyond_every_candidate_count_uses_the_whole_row() -> None:
    vocab = 20000
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(6)) * 0.01
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 2
    generator = torch.Generator().manual_seed(8)
    draws = set()
    for _ in range(20):
        uniforms = torch.rand(2, dtype=torch.float64, generator=generator)
        chosen = choose_native(logits, [0, 1], params, uniforms, kernels)
        assert _check_draws(logits, [0, 1], params, uniforms, chosen) >= 1
        draws.update(chosen.tolist())
    assert len(draws) > 30


def _chunk(params: SamplingParams, request_id: str, output: list[int]) -> ScheduledChunk:
    return sampling_chunk(params, request_id, [1, 2, 3], output, eos=0)


def test_a_mixed_batch_matches_the_reference_row_by_row() -> None:
    """Greedy, plain sampled (read in place, bf16), penalised and logprob rows in one batch."""
    rng = random.Random(9)
    vocab = 3000
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.9, presence_penalty=0.5, top_k=20),
        SamplingParams(temperature=1.1, logprobs=2, top_p=0.9),
        SamplingParams(temperature=0.0, frequency_penalty=0.3),
    ]
    chunks = [
        _chunk(kinds[i % 6], f"r{i}", [rng.randrange(vocab) for _ in range(5)]) for i in range(24)
    ]
    logits = _logits(10, 24, vocab, torch.bfloat16)
    generator = torch.Generator().manual_seed(11)
    compared = skipped = 0
    for _ in range(10):
        uniforms = torch.rand(24, dtype=torch.float64, generator=generator)
        token_ids, logprobs = sample_rows(logits, chunks, uniforms, kernels)
        for row, chunk in enumerate(chunks):
            expected, entry = reference_sample(logits[row], chunk, float(uniforms[row]))
            params = chunk.sampling_params
            if not params.greedy:
                probs = reference_probs(reference_logits(logits[row], chunk), params)
                if _near_boundary(probs, float(uniforms[row])):
                    skipped += 1
                    continue
            assert token_ids[row] == expected, (row, params)
            if entry is not None:  # logprobs come from the torch path: identical
                assert logprobs[row].logprob == entry.logprob
            compared += 1
    assert skipped <= 0.05 * (compared + skipped)


def test_a_seed_gives_the_same_tokens_alone_or_in_a_batch_with_kernels() -> None:
    vocab = 3000
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=42)
    others = [SamplingParams(temperature=1.0, top_k=50), SamplingParams(temperature=0.0)]
    logits = _logits(12, 3, vocab, torch.bfloat16)

    def run(batch: bool) -> list[int]:
        sampler = Sampler(seed=1, kernels=kernels)
        drawn = []
        for step in range(20):
            chunks = [_chunk(seeded, "s", [])]
            rows = logits[:1]
            if batch:
                chunks += [_chunk(p, f"o{j}", []) for j, p in enumerate(others)]
                rows = logits
            drawn.append(sampler.sample(rows.roll(step, dims=1).contiguous(), chunks)[0][0])
        return drawn

    alone = run(False)
    assert alone == run(True) and len(set(alone)) > 1
