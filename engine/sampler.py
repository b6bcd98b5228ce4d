"""Sampler: logits of the sampling rows -> one token id per row (+ optional logprobs).

Order of processing for a row: logit_bias -> min_tokens ban of EOS/stop ids -> repetition,
presence and frequency penalties -> (logprobs are taken here, before temperature) ->
greedy argmax, or temperature -> top-k -> top-p -> min-p -> draw.
A request with a seed draws from its own torch.Generator, so its samples do not depend on
what else shares the batch; unseeded requests share one engine generator.
"""

from __future__ import annotations

import torch

from scheduler.output import ScheduledChunk, TokenLogprobs
from scheduler.sampling_params import SamplingParams


class Sampler:
    """Owns per-request generators; forget() drops them when requests finish."""

    def __init__(self, seed: int = 0, kernels=None) -> None:
        self.kernels = kernels  # native argmax for the greedy fast path, when built
        self.shared_generator = torch.Generator().manual_seed(seed)
        self.generators: dict[str, torch.Generator] = {}

    def forget(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self.generators.pop(request_id, None)

    def sample(
        self, logits: torch.Tensor, chunks: list[ScheduledChunk]
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [len(chunks), vocab] (any float dtype), row i belongs to chunks[i]."""
        if not any(_needs_processing(c) for c in chunks):
            return self._greedy(logits), [None] * len(chunks)
        logits = logits.to(torch.float32, copy=True)  # processors write into it
        for row, chunk in enumerate(chunks):
            _apply_logit_processors(logits[row], chunk)
        logprobs_all = None
        if any(c.sampling_params.logprobs is not None for c in chunks):
            logprobs_all = torch.log_softmax(logits, dim=-1)
        token_ids = self._choose(logits, chunks)
        return token_ids, [
            _token_logprobs(logprobs_all[row], token_ids[row], chunk.sampling_params.logprobs)
            if logprobs_all is not None and chunk.sampling_params.logprobs is not None
            else None
            for row, chunk in enumerate(chunks)
        ]

    def _greedy(self, logits: torch.Tensor) -> list[int]:
        """First maximum of each row, on the logits' own dtype (widening bf16 is exact)."""
        if self.kernels is not None and logits.is_contiguous():
            return self.kernels.argmax_rows(logits).tolist()  # ~10x torch's bf16 max
        # max(...).indices: same first-maximum rule as argmax, measurably faster on CPU.
        return logits.max(dim=-1).indices.tolist()

    def _choose(self, logits: torch.Tensor, chunks: list[ScheduledChunk]) -> list[int]:
        token_ids = logits.argmax(dim=-1).tolist()
        for row, chunk in enumerate(chunks):
            params = chunk.sampling_params
            if not params.greedy:
                probs = _filtered_probs(logits[row], params)
                generator = self._generator_for(chunk.request_id, params)
                token_ids[row] = int(torch.multinomial(probs, 1, generator=generator))
        return token_ids

    def _generator_for(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.shared_generator
        generator = self.generators.get(request_id)
        if generator is None:
            generator = torch.Generator().manual_seed(params.seed)
            self.generators[request_id] = generator
        return generator


def _needs_processing(chunk: ScheduledChunk) -> bool:
    params = chunk.sampling_params
    return (
        not params.greedy
        or params.logprobs is not None
        or params.uses_penalties
        or bool(params.logit_bias)
        or len(chunk.output_token_ids) < params.min_tokens
    )


def _apply_logit_processors(row: torch.Tensor, chunk: ScheduledChunk) -> None:
    """In place on one row of logits."""
    params = chunk.sampling_params
    for token_id, bias in params.logit_bias:
        if token_id < row.shape[0]:
            row[token_id] += bias
    if len(chunk.output_token_ids) < params.min_tokens:
        eos = () if params.ignore_eos else tuple(chunk.eos_token_ids)
        banned = [t for t in (*eos, *params.stop_token_ids) if t < row.shape[0]]
        row[banned] = float("-inf")
    if params.uses_penalties:
        _apply_penalties(row, chunk)


def _apply_penalties(row: torch.Tensor, chunk: ScheduledChunk) -> None:
    params = chunk.sampling_params
    if params.repetition_penalty != 1.0:
        # Hugging Face's rule: over prompt and output tokens, divide positive logits by the
        # penalty and multiply negative ones.
        seen = torch.tensor(sorted({*chunk.prompt_token_ids, *chunk.output_token_ids}))
        scores = row[seen]
        penalty = params.repetition_penalty
        row[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    if chunk.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(chunk.output_token_ids), minlength=row.shape[0])
        counts = counts[: row.shape[0]].to(row.dtype)
        row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            row.dtype
        )


def _filtered_probs(row: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, top-p and min-p filtering; returns a probability vector."""
    scaled = row / params.temperature
    if 0 < params.top_k < scaled.shape[0]:
        kth = torch.topk(scaled, params.top_k).values[-1]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p: a token is out once the mass
        # before it already reaches top_p (the first token always stays: top_p > 0).
        outside = sorted_probs.cumsum(0) - sorted_probs >= params.top_p
        probs = probs.clone()
        probs[order[outside]] = 0.0
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def _token_logprobs(logprobs: torch.Tensor, token_id: int, top: int) -> TokenLogprobs:
    result = TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]))
    if top > 0:
        values, ids = torch.topk(logprobs, top)
        result.top_token_ids = ids.tolist()
        result.top_logprobs = values.tolist()
    return result
