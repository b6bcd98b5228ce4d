"""Verifying drafts (engine/draft_verification.py) with the real sampler: greedy keeps the
argmax chain; sampled output has the plain sampler's distribution (rejection sampling with a
one-token draft distribution), checked by counting over many rows with a fixed seed."""

from __future__ import annotations

import torch

from engine.draft_verification import sample_row_chunks, verify
from engine.forward_batch import build_lists
from engine.sampler import Sampler
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams


def chunk(request_id: str, drafts: list[int], **params: object) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        token_ids=[3, *drafts],
        start_position=8,
        block_table=[0, 1, 2, 3],
        samples=True,
        num_prompt_tokens=6,
        sampling_params=SamplingParams(**params),  # type: ignore[arg-type]
        prompt_token_ids=[1] * 6,
        output_token_ids=[4, 3],
        draft_token_ids=list(drafts),
    )


def test_each_row_sees_the_drafts_before_it_as_outputs() -> None:
    rows = sample_row_chunks([chunk("a", [5, 6]), chunk("b", [])])
    assert [(r.request_id, r.output_token_ids) for r in rows] == [
        ("a", [4, 3]),
        ("a", [4, 3, 5]),
        ("a", [4, 3, 5, 6]),
        ("b", [4, 3]),
    ]
    assert all(not r.draft_token_ids for r in rows)


def test_sample_rows_are_the_last_known_token_and_every_draft_as_single_decodes() -> None:
    lists = build_lists([chunk("a", []), chunk("b", [5, 6])], block_size=4)
    assert lists.sample_rows == [0, 1, 2, 3]
    # b's three rows attend causally: one-token decode spans at positions 8, 9, 10.
    assert [(s.query_start, s.query_len, s.start_position) for s in lists.spans] == [
        (0, 1, 8),
        (1, 1, 8),
        (2, 1, 9),
        (3, 1, 10),
    ]
    assert lists.num_decodes == 4


def test_greedy_keeps_drafts_while_they_are_the_argmax() -> None:
    chunks = [chunk("a", [2, 4, 1], temperature=0.0), chunk("b", [3], temperature=0.0)]
    logits = torch.full((6, 6), -5.0)
    for row, best in enumerate([2, 4, 0, 5, 1, 3]):  # a: 2 4 kept, 1 rejected for 0
        logits[row, best] = 5.0
    rows = sample_row_chunks(chunks)
    token_ids, logprobs = Sampler(seed=0).sample(logits, rows)
    verdicts = verify(chunks, token_ids, logprobs)
    assert [(v.accepted, v.token_id) for v in verdicts] == [([2, 4], 0), ([], 1)]


def test_sampled_output_has_the_plain_samplers_distribution() -> None:
    vocab, num_requests = 4, 6000
    dists = [
        torch.tensor([0.5, 0.2, 0.2, 0.1]),
        torch.tensor([0.1, 0.6, 0.2, 0.1]),
        torch.tensor([0.25, 0.25, 0.25, 0.25]),
    ]
    drafts = [0, 1]  # likely drafts: both kept about 0.5 * 0.6 of the time
    chunks = [chunk(f"r{i}", drafts, temperature=1.0) for i in range(num_requests)]
    logits = torch.stack([d.log() for d in dists] * num_requests)
    token_ids, logprobs = Sampler(seed=0).sample(logits, sample_row_chunks(chunks))
    verdicts = verify(chunks, token_ids, logprobs)
    emitted = [[*v.accepted, v.token_id] for v in verdicts]
    # First token ~ dists[0]; given it is draft 0, the second ~ dists[1]; given 0 1, the
    # third ~ dists[2]. Total variation within 0.03 (about 4 standard errors per cell).
    for position, dist in enumerate(dists):
        prefix = drafts[:position]
        tokens = [e[position] for e in emitted if len(e) > position and e[:position] == prefix]
        counts = torch.bincount(torch.tensor(tokens), minlength=vocab).double()
        assert len(tokens) > 1000
        assert 0.5 * (counts / counts.sum() - dist.double()).abs().sum() < 0.03
    accepted_both = sum(len(v.accepted) == 2 for v in verdicts) / num_requests
    assert abs(accepted_both - 0.5 * 0.6) < 0.03


def test_a_penalty_applies_to_the_drafts_before_the_row() -> None:
    # Token 5 is a draft; the row after it sees 5 as an output and a repetition penalty
    # pushes 5 below token 0 there, while the first row (before the draft) still picks 5.
    chunks = [chunk("a", [5], temperature=0.0, repetition_penalty=2.0)]
    logits = torch.tensor([[1.2, 0, 0, 0, 0, 2.0], [1.2, 0, 0, 0, 0, 2.0]])
    token_ids, logprobs = Sampler(seed=0).sample(logits, sample_row_chunks(chunks))
    assert token_ids == [5, 0]
    (verdict,) = verify(chunks, token_ids, logprobs)
    assert (verdict.accepted, verdict.token_id) == ([5], 0)
