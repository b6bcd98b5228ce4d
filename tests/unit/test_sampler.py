"""Sampler: greedy fast path, support restriction by temperature/top-k/top-p/min-p, seeds,
penalties, logit_bias, min_tokens, logprobs.

Logprobs are taken after logit_bias, min_tokens and penalties (before temperature), so the
processed logits of a row can be read back exactly from a request that asks for the full
vocabulary's logprobs: that is how the penalty definitions are checked.
"""

from __future__ import annotations

import math
import random
from collections import Counter

import pytest
import torch
from sampling_chunks import sampling_chunk

import engine.sampler as sampler_module
from engine.kernels import load_cpu_kernels
from engine.sampler import Sampler, sample_rows
from engine.sampling.logit_processors import processed_logits
from engine.sampling.reference import (
    reference_draw,
    reference_logits,
    reference_probs,
    reference_sample,
)
from engine.sampling.truncation import CANDIDATE_COUNTS, inverse_cdf, kept_tokens
from scheduler.logit_bias import LogitBias
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams

VOCAB = 12
EOS = 11


def _chunk(
    params: SamplingParams,
    request_id: str = "r",
    prompt: list[int] | None = None,
    output: list[int] | None = None,
) -> ScheduledChunk:
    return sampling_chunk(params, request_id, prompt, output, eos=EOS)


def _logits(values: list[float]) -> torch.Tensor:
    return torch.tensor([values], dtype=torch.float32)


# probabilities 0.5, 0.3, 0.1, 0.05, 0.05 over tokens 0..4; the rest of the vocabulary is
# nearly impossible (exp(-30)) but not zero, so any filter that keeps it would show.
PROBS = [0.5, 0.3, 0.1, 0.05, 0.05]
BASE_LOGITS = [math.log(p) for p in PROBS] + [-30.0] * (VOCAB - len(PROBS))


def _draw(params: SamplingParams, n: int, logits: list[float] = BASE_LOGITS) -> Counter:
    """n independent draws (one row each, the shared generator)."""
    sampler = Sampler(seed=1234)
    rows = torch.tensor([logits] * n, dtype=torch.float32)
    chunks = [_chunk(params, request_id=f"r{i}") for i in range(n)]
    token_ids, _ = sampler.sample(rows, chunks)
    return Counter(token_ids)


def test_greedy_fast_path_is_argmax_without_logprobs() -> None:
    logits = torch.randn(5, VOCAB, generator=torch.Generator().manual_seed(0))
    chunks = [_chunk(SamplingParams(temperature=0.0), request_id=f"r{i}") for i in range(5)]
    token_ids, logprobs = Sampler().sample(logits, chunks)
    assert token_ids == logits.argmax(dim=-1).tolist()
    assert logprobs == [None] * 5


def test_greedy_ties_pick_the_lowest_token_id_like_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    chunks = [_chunk(SamplingParams(temperature=0.0), request_id=f"r{i}") for i in range(2)]
    assert Sampler().sample(logits, chunks)[0] == [1, 0]
    with_logprobs = [_chunk(SamplingParams(temperature=0.0, logprobs=1), f"p{i}") for i in range(2)]
    assert Sampler().sample(logits, with_logprobs)[0] == [1, 0]


def test_greedy_rows_next_to_sampled_rows_stay_argmax() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=3)] * 2
    chunks = [_chunk(p, request_id=f"r{i}") for i, p in enumerate(params)]
    token_ids, _ = Sampler().sample(logits, chunks)
    assert token_ids[0] == int(logits[0].argmax()) and token_ids[2] == int(logits[2].argmax())


def test_temperature_one_draws_follow_softmax() -> None:
    counts = _draw(SamplingParams(temperature=1.0), 4000)
    assert set(counts) <= {0, 1, 2, 3, 4}
    for token, p in enumerate(PROBS):
        assert abs(counts[token] / 4000 - p) < 0.03, (token, counts)


def test_low_temperature_sharpens_the_distribution() -> None:
    # T = 0.5 squares the probabilities: 0.25, 0.09, 0.01, ... renormalized -> token 0 ~ 0.70
    counts = _draw(SamplingParams(temperature=0.5), 3000)
    expected = [p**2 / sum(q**2 for q in PROBS) for p in PROBS]
    for token, p in enumerate(expected):
        assert abs(counts[token] / 3000 - p) < 0.03, (token, counts)


def test_top_k_keeps_exactly_the_k_most_likely() -> None:
    counts = _draw(SamplingParams(temperature=1.0, top_k=2), 2000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04


@pytest.mark.parametrize(
    ("top_p", "support"),
    [(0.45, {0}), (0.75, {0, 1}), (0.85, {0, 1, 2}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_the_smallest_prefix_reaching_p(top_p: float, support: set[int]) -> None:
    counts = _draw(SamplingParams(temperature=1.0, top_p=top_p), 2000)
    assert set(counts) == support


def test_top_p_stops_at_the_token_whose_mass_reaches_p_exactly() -> None:
    # Probabilities exact in binary: 0.5 + 0.25 reaches top_p = 0.75, so token 2 is out
    # (Hugging Face's and vLLM's rule: drop tokens whose ascending cumulative mass <= 1 - p).
    logits = [math.log(p) for p in (0.5, 0.25, 0.125, 0.125)] + [-30.0] * (VOCAB - 4)
    counts = _draw(SamplingParams(temperature=1.0, top_p=0.75), 2000, logits)
    assert set(counts) == {0, 1}


def test_top_p_renormalizes_the_kept_tokens() -> None:
    counts = _draw(SamplingParams(temperature=1.0, top_p=0.75), 3000)
    assert abs(counts[0] / 3000 - 0.5 / 0.8) < 0.03


@pytest.mark.parametrize(("min_p", "support"), [(0.15, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_min_p_times_the_top_probability(min_p, support) -> None:
    counts = _draw(SamplingParams(temperature=1.0, min_p=min_p), 2000)
    assert set(counts) == support


def test_filters_combine() -> None:
    counts = _draw(SamplingParams(temperature=1.0, top_k=4, top_p=0.85, min_p=0.25), 2000)
    assert set(counts) == {0, 1}  # top_k -> 0..3, top_p -> 0..2, min_p 0.125 -> 0, 1


def _sequence(sampler: Sampler, chunk: ScheduledChunk, logits: torch.Tensor, others=()) -> list:
    """Five steps of one request, optionally batched after other rows."""
    drawn = []
    for _ in range(5):
        rows = torch.cat([logits] + [o[1] for o in others])
        token_ids, _ = sampler.sample(rows, [chunk] + [o[0] for o in others])
        drawn.append(token_ids[0])
    return drawn


def test_seeded_request_is_reproducible_and_independent_of_batch() -> None:
    flat = _logits([0.0] * VOCAB)  # uniform: every draw is up to the generator
    params = SamplingParams(temperature=1.0, seed=42)
    alone = _sequence(Sampler(seed=0), _chunk(params, "a"), flat)
    assert alone == _sequence(Sampler(seed=99), _chunk(params, "a"), flat)
    # Placed first or last, next to seeded and unseeded neighbours, it draws the same.
    others = [
        (_chunk(SamplingParams(temperature=1.0), "u"), flat),
        (_chunk(SamplingParams(temperature=1.0, seed=7), "s"), flat),
        (_chunk(SamplingParams(temperature=0.0), "g"), flat),
    ]
    assert alone == _sequence(Sampler(seed=5), _chunk(params, "a"), flat, others)
    sampler = Sampler(seed=5)
    drawn = []
    for _ in range(5):
        rows = torch.cat([flat] * 4)
        chunks = [others[0][0], others[1][0], others[2][0], _chunk(params, "a")]
        drawn.append(sampler.sample(rows, chunks)[0][3])
    assert drawn == alone
    assert len(set(alone)) > 1  # the draws are not trivially constant


def test_different_seeds_differ_and_forget_restarts_the_stream() -> None:
    flat = _logits([0.0] * VOCAB)
    sampler = Sampler()
    a = _sequence(sampler, _chunk(SamplingParams(temperature=1.0, seed=1), "a"), flat)
    b = _sequence(sampler, _chunk(SamplingParams(temperature=1.0, seed=2), "b"), flat)
    assert a != b
    sampler.forget(["a"])
    assert _sequence(sampler, _chunk(SamplingParams(temperature=1.0, seed=1), "a"), flat) == a


def _processed_logprobs(params: SamplingParams, logits: list[float], **chunk_kwargs):
    """The row's log_softmax after logit processors, read from a full-vocabulary logprobs."""
    params_with_logprobs = _with(params, logprobs=VOCAB)
    chunk = _chunk(params_with_logprobs, **chunk_kwargs)
    token_ids, logprobs = Sampler().sample(_logits(logits), [chunk])
    result = logprobs[0]
    table = dict(zip(result.top_token_ids, result.top_logprobs, strict=True))
    return token_ids[0], torch.tensor([table[t] for t in range(VOCAB)])


def _with(params: SamplingParams, **changes) -> SamplingParams:
    fields = {name: getattr(params, name) for name in SamplingParams.__dataclass_fields__}
    return SamplingParams(**{**fields, **changes})


RAW = [2.0, -1.0, 0.5, -0.5, 1.5, 0.0, 3.0, -2.0, 1.0, -3.0, 0.25, 0.75]


def _assert_logits_equal_up_to_constant(logprobs: torch.Tensor, expected_logits: list[float]):
    torch.testing.assert_close(
        logprobs, torch.log_softmax(torch.tensor(expected_logits), dim=-1), atol=1e-5, rtol=0
    )


def test_repetition_penalty_follows_hugging_face_rule() -> None:
    # Seen tokens (prompt 0, 1 and output 3, 4): positive logits / 1.5, negative ones * 1.5.
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    _, logprobs = _processed_logprobs(params, RAW, prompt=[0, 1], output=[3, 4])
    expected = list(RAW)
    for t in (0, 1, 3, 4):
        expected[t] = RAW[t] / 1.5 if RAW[t] > 0 else RAW[t] * 1.5
    _assert_logits_equal_up_to_constant(logprobs, expected)


def test_presence_and_frequency_penalties_follow_openai_definition() -> None:
    # logit[t] -= frequency * count_t + presence * (count_t > 0), over output tokens only.
    params = SamplingParams(temperature=0.0, presence_penalty=0.7, frequency_penalty=0.4)
    _, logprobs = _processed_logprobs(params, RAW, prompt=[5, 6], output=[3, 3, 3, 8])
    expected = list(RAW)
    expected[3] -= 0.4 * 3 + 0.7
    expected[8] -= 0.4 * 1 + 0.7
    _assert_logits_equal_up_to_constant(logprobs, expected)


def test_negative_presence_penalty_encourages_repeats() -> None:
    params = SamplingParams(temperature=0.0, presence_penalty=-2.0)
    token_id, _ = _processed_logprobs(params, RAW, output=[2])  # 0.5 + 2 = 2.5 < 3.0
    assert token_id == 6
    token_id, _ = _processed_logprobs(params, RAW, output=[0])  # 2.0 + 2 = 4.0 > 3.0
    assert token_id == 0


def test_logit_bias_adds_to_logits_and_changes_greedy_choice() -> None:
    params = SamplingParams(temperature=0.0, logit_bias=LogitBias.of(((1, 5.0), (6, -100.0))))
    token_id, logprobs = _processed_logprobs(params, RAW)
    expected = list(RAW)
    expected[1] += 5.0
    expected[6] -= 100.0
    _assert_logits_equal_up_to_constant(logprobs, expected)
    assert token_id == 1


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = list(RAW)
    logits[EOS] = 10.0  # EOS would win greedily
    logits[7] = 9.0  # then stop id 7
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(7,), logprobs=VOCAB)
    token_ids, logprobs = Sampler().sample(_logits(logits), [_chunk(params, output=[4, 4])])
    assert token_ids == [6]
    table = dict(zip(logprobs[0].top_token_ids, logprobs[0].top_logprobs, strict=True))
    assert table[EOS] == -math.inf and table[7] == -math.inf
    # Once min_tokens outputs exist, EOS may be chosen again.
    token_ids, _ = Sampler().sample(_logits(logits), [_chunk(params, output=[4, 4, 4])])
    assert token_ids == [EOS]


def test_min_tokens_with_ignore_eos_bans_only_stop_ids() -> None:
    logits = list(RAW)
    logits[EOS], logits[7] = 10.0, 11.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=(7,), ignore_eos=True)
    token_ids, _ = Sampler().sample(_logits(logits), [_chunk(params)])
    assert token_ids == [EOS]


def test_min_tokens_never_samples_banned_ids() -> None:
    logits = [0.0] * VOCAB
    logits[EOS] = 5.0
    params = SamplingParams(temperature=1.0, min_tokens=4, stop_token_ids=(2,))
    counts = _draw_with(params, logits, 500)
    assert EOS not in counts and 2 not in counts and len(counts) == VOCAB - 2


def _draw_with(params: SamplingParams, logits: list[float], n: int) -> Counter:
    rows = torch.tensor([logits] * n)
    chunks = [_chunk(params, request_id=f"r{i}") for i in range(n)]
    return Counter(Sampler(seed=3).sample(rows, chunks)[0])


def test_logprobs_of_chosen_and_top_alternatives_are_log_softmax() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2)) * 3
    params = [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, seed=11, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    chunks = [_chunk(p, request_id=f"r{i}") for i, p in enumerate(params)]
    token_ids, logprobs = Sampler().sample(logits, chunks)
    expected = torch.log_softmax(logits.double(), dim=-1)
    first = logprobs[0]
    assert first.token_id == token_ids[0] == int(logits[0].argmax())
    assert first.logprob == pytest.approx(float(expected[0, token_ids[0]]), abs=1e-5)
    top = torch.topk(expected[0], 3)
    assert first.top_token_ids == top.indices.tolist()
    assert first.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-5)
    # logprobs=0: the chosen token only (sampled, so not necessarily the argmax).
    second = logprobs[1]
    assert second.token_id == token_ids[1]
    assert second.logprob == pytest.approx(float(expected[1, token_ids[1]]), abs=1e-5)
    assert second.top_token_ids == [] and second.top_logprobs == []
    assert logprobs[2] is None


def test_logprobs_are_taken_before_temperature() -> None:
    logits = torch.tensor([RAW])
    params = SamplingParams(temperature=0.3, seed=1, logprobs=2)
    token_ids, logprobs = Sampler().sample(logits, [_chunk(params)])
    expected = torch.log_softmax(logits[0].double(), dim=-1)
    assert logprobs[0].logprob == pytest.approx(float(expected[token_ids[0]]), abs=1e-5)


# --- the batched sampler against the plain per-row reference ---------------------------------


def _random_params(rng: random.Random, vocab: int) -> SamplingParams:
    greedy = rng.random() < 0.2
    return SamplingParams(
        temperature=0.0 if greedy else rng.choice([0.3, 0.8, 1.0, 1.5]),
        top_k=rng.choice([0, 0, 0, 1, 7, 100, 300, vocab - 1, vocab + 5]),
        top_p=rng.choice([1.0, 1.0, 0.3, 0.9, 0.95, 0.99]),
        min_p=rng.choice([0.0, 0.0, 0.02, 0.4]),
        repetition_penalty=rng.choice([1.0, 1.0, 1.3, 0.7]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3]),
        logit_bias=LogitBias.of((t, rng.uniform(-5, 5)) for t in rng.sample(range(vocab + 3), 3))
        if rng.random() < 0.3
        else LogitBias(),
        min_tokens=rng.choice([0, 0, 3]),
        stop_token_ids=(rng.randrange(vocab),),
        seed=rng.choice([None, rng.randrange(1000)]),
        logprobs=rng.choice([None, None, 0, 5]),
    )


def _random_chunks(rng: random.Random, vocab: int, n: int) -> list[ScheduledChunk]:
    return [
        _chunk(
            _random_params(rng, vocab),
            request_id=f"r{i}",
            prompt=[rng.randrange(vocab) for _ in range(rng.randrange(1, 30))],
            output=[rng.randrange(vocab) for _ in range(rng.randrange(0, 6))],
        )
        for i in range(n)
    ]


def _random_logits(generator: torch.Generator, rows: int, vocab: int, dtype) -> torch.Tensor:
    # Per-row spread from flat (huge nucleus, candidate growth) to peaked; bf16 adds ties.
    scale = torch.tensor([0.05, 1.0, 3.0, 8.0]).repeat(rows)[:rows, None]
    return (torch.randn(rows, vocab, generator=generator) * scale).to(dtype)


def _batched_distribution(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    dense = torch.zeros_like(probs)
    for group in kept_tokens(probs, params):
        weights = torch.zeros(len(group.rows), probs.shape[1]).scatter_(
            1, group.token_ids, group.weights
        )
        dense[group.rows] = weights / weights.sum(dim=1, keepdim=True)
    return dense


@pytest.mark.parametrize(("case", "dtype"), [(0, torch.float32), (1, torch.bfloat16), (2, None)])
def test_batched_sampler_matches_the_reference(case: int, dtype) -> None:
    rng = random.Random(case)
    generator = torch.Generator().manual_seed(case)
    vocab = 5000 if dtype is not None else 300
    logits = _random_logits(generator, 48, vocab, dtype or torch.float32)
    chunks = _random_chunks(rng, vocab, 48)
    uniforms = torch.rand(48, dtype=torch.float64, generator=generator)
    rows = list(range(48))
    # Processors: the same float operations, so bit-identical.
    work = processed_logits(logits, rows, chunks)
    for row in rows:
        assert torch.equal(work[row], reference_logits(logits[row], chunks[row])), row
    # Kept sets and probabilities of the sampled rows.
    sampled = [r for r in rows if not chunks[r].sampling_params.greedy]
    params = [chunks[r].sampling_params for r in sampled]
    temperature = torch.tensor([p.temperature for p in params])[:, None]
    batched = _batched_distribution(torch.softmax(work[sampled] / temperature, dim=-1), params)
    for i, row in enumerate(sampled):
        expected = reference_probs(work[row], params[i])
        assert torch.equal(batched[i] > 0, expected > 0), row
        torch.testing.assert_close(batched[i], expected, atol=1e-6, rtol=1e-5)
    # Tokens and logprobs, for the same uniforms.
    token_ids, logprobs = sample_rows(logits, chunks, uniforms)
    for row in rows:
        expected_id, expected_logprobs = reference_sample(
            logits[row], chunks[row], float(uniforms[row])
        )
        assert token_ids[row] == expected_id, row
        assert logprobs[row] == expected_logprobs, row


def test_candidates_grow_until_the_nucleus_fits() -> None:
    # A flat row: the top 4096 candidates hold far less than top_p, the whole vocabulary is
    # sorted. Steeper rows stop at 1024, 256 or the first 64 candidates.
    vocab = 20000
    generator = torch.Generator().manual_seed(7)
    scale = torch.tensor([[0.01], [3.0], [3.5], [9.0]])  # nuclei ~18000, ~870, ~150, 1
    logits = torch.randn(4, vocab, generator=generator) * scale
    params = [SamplingParams(temperature=1.0, top_p=0.9)] * 4
    probs = torch.softmax(logits, dim=-1)
    sizes = {}
    for group in kept_tokens(probs, params):
        for row in group.rows.tolist():
            sizes[row] = group.token_ids.shape[1]
    assert sizes == {0: vocab, 1: 1024, 2: 256, 3: 64}
    batched = _batched_distribution(probs, params)
    for row in range(4):
        expected = reference_probs(logits[row], params[row])
        assert torch.equal(batched[row] > 0, expected > 0), row
        torch.testing.assert_close(batched[row], expected, atol=1e-7, rtol=1e-5)
    assert int((batched[0] > 0).sum()) > CANDIDATE_COUNTS[-1]


def test_top_p_cut_inside_a_tie_keeps_the_lowest_token_ids() -> None:
    # 200 equally likely tokens (ids spread over the vocabulary) and top_p = 0.5: the 100
    # lowest ids stay, whichever 64 of them torch.topk happened to return first.
    vocab = 1000
    tied = torch.randperm(vocab, generator=torch.Generator().manual_seed(3))[:200]
    logits = torch.full((1, vocab), -1e4)
    logits[0, tied] = 0.0
    params = [SamplingParams(temperature=1.0, top_p=0.5)]
    batched = _batched_distribution(torch.softmax(logits, dim=-1), params)
    assert set(batched[0].nonzero().squeeze(1).tolist()) == set(tied.sort().values[:100].tolist())
    assert torch.equal(batched[0], reference_probs(logits[0], params[0]))


def test_top_k_keeps_every_tie_of_the_kth_probability() -> None:
    # Token 5 leads; 150 tokens tie for second place: top_k = 2 keeps all 151.
    vocab = 1000
    logits = torch.full((1, vocab), -1e4)
    logits[0, 5] = 2.0
    logits[0, 300:450] = 1.0
    params = [SamplingParams(temperature=1.0, top_k=2)]
    batched = _batched_distribution(torch.softmax(logits, dim=-1), params)
    assert set(batched[0].nonzero().squeeze(1).tolist()) == {5, *range(300, 450)}
    torch.testing.assert_close(batched[0], reference_probs(logits[0], params[0]))
    # Then top_p: p(5) = e / (e + 150) ~ 0.018 and each tie ~ 0.0066, so top_p = 0.03 keeps
    # token 5 and 2 ties. Renormalized over only the first 64 candidates, p(5) would look like
    # 0.041 and keep token 5 alone, above every tie: seemingly complete.
    params = [SamplingParams(temperature=1.0, top_k=2, top_p=0.03)]
    batched = _batched_distribution(torch.softmax(logits, dim=-1), params)
    expected = reference_probs(logits[0], params[0])
    assert int((expected > 0).sum()) == 3
    assert torch.equal(batched[0] > 0, expected > 0)
    torch.testing.assert_close(batched[0], expected)


def test_inverse_cdf_walks_ascending_token_ids_and_skips_dropped_tokens() -> None:
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.3, 0.2, 0.0]])
    for uniform, token_id in [(0.0, 1), (0.49, 1), (0.51, 3), (0.79, 3), (0.81, 4), (1 - 1e-12, 4)]:
        u = torch.tensor([uniform], dtype=torch.float64)
        assert int(inverse_cdf(probs, u)) == token_id, uniform
        assert reference_draw(probs[0], uniform) == token_id, uniform


def test_greedy_rows_skip_processing_and_stay_exact_argmax(monkeypatch) -> None:
    generator = torch.Generator().manual_seed(4)
    logits = (torch.randn(32, 5000, generator=generator) * 4).to(torch.bfloat16)
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_p=0.95),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, repetition_penalty=1.2, logprobs=2),
    ] * 8
    chunks = [_chunk(p, request_id=f"r{i}") for i, p in enumerate(params)]
    processed_rows = []

    def spy(logits, rows, chunks):
        processed_rows.append(rows)
        return processed_logits(logits, rows, chunks)

    monkeypatch.setattr(sampler_module, "processed_logits", spy)
    for kernels in _kernel_choices():
        token_ids, _ = Sampler(seed=0, kernels=kernels).sample(logits, chunks)
        plain = [r for r in range(32) if r % 4 in (0, 2)]
        assert [token_ids[r] for r in plain] == logits[plain].float().argmax(dim=-1).tolist()
        # With the kernels, rows that only sample are drawn from the logits in place, uncopied.
        copied = (1, 3) if kernels is None else (3,)
        assert processed_rows.pop() == [r for r in range(32) if r % 4 in copied]


def _kernel_choices() -> list:
    kernels = load_cpu_kernels()
    return [None] if kernels is None else [None, kernels]


def test_seeded_requests_draw_the_same_alone_and_in_a_batch_of_64() -> None:
    vocab = 8192
    generator = torch.Generator().manual_seed(5)
    rng = random.Random(5)
    # A peaked seeded request, a flat one (its nucleus needs the whole-vocabulary sort) and a
    # plain-temperature one, against 61 mixed neighbours that change every step.
    mine = {
        "peaked": (SamplingParams(temperature=0.8, top_p=0.95, seed=11), 4.0),
        "flat": (SamplingParams(temperature=1.0, top_p=0.9, top_k=5000, seed=12), 0.02),
        "plain": (SamplingParams(temperature=1.2, seed=13), 2.0),
    }
    steps = [
        {
            name: torch.randn(1, vocab, generator=generator) * scale
            for name, (_, scale) in mine.items()
        }
        for _ in range(6)
    ]
    alone = {}
    for name, (params, _) in mine.items():
        sampler = Sampler(seed=1)
        alone[name] = [sampler.sample(step[name], [_chunk(params, name)])[0][0] for step in steps]
    sampler = Sampler(seed=2)
    together = {name: [] for name in mine}
    for step in steps:
        others = _random_chunks(rng, vocab, 61)
        rows = [*others[:20], None, *others[20:40], None, *others[40:], None]
        positions = {name: i for i, name in zip([20, 41, 63], mine, strict=True)}
        for name, i in positions.items():
            rows[i] = _chunk(mine[name][0], name)
        logits = _random_logits(generator, 64, vocab, torch.bfloat16).float()
        for name, i in positions.items():
            logits[i] = step[name][0]
        token_ids, _ = sampler.sample(logits, rows)
        for name, i in positions.items():
            together[name].append(token_ids[i])
    assert together == alone
    assert all(len(set(tokens)) > 1 for tokens in alone.values())


def test_unseeded_streams_differ_between_samplers_unless_seeded() -> None:
    flat = _logits([0.0] * VOCAB)
    chunk = _chunk(SamplingParams(temperature=1.0), "u")
    assert _sequence(Sampler(), chunk, flat) != _sequence(Sampler(), chunk, flat)
    assert _sequence(Sampler(seed=8), chunk, flat) == _sequence(Sampler(seed=8), chunk, flat)
