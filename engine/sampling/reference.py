"""Plain per-row reference of the sampler, the definition the batched code is tested against.

One row of logits and its chunk -> processed logits -> (logprobs) -> probabilities -> the
token a given uniform u in [0, 1) picks. It loops, sorts the whole vocabulary and favours
clarity over speed; Sampler never calls it.
"""

from __future__ import annotations

import torch

from scheduler.output import ScheduledChunk, TokenLogprobs
from scheduler.sampling_params import SamplingParams


def reference_sample(
    row: torch.Tensor, chunk: ScheduledChunk, uniform: float, bitmask: torch.Tensor | None = None
) -> tuple[int, TokenLogprobs | None]:
    """The token (and logprobs, when asked) of one row; uniform is ignored by greedy rows.
    bitmask: the row's allowed tokens (structured output), applied after logprobs are taken,
    so logprobs are the model's processed distribution, not the grammar's."""
    params = chunk.sampling_params
    logits = reference_logits(row, chunk)
    allowed = logits if bitmask is None else reference_token_bitmask(logits, bitmask)
    if params.greedy:
        token_id = int(allowed.argmax())
    else:
        token_id = reference_draw(reference_probs(allowed, params), uniform)
    if params.logprobs is None:
        return token_id, None
    logprobs = torch.log_softmax(logits, dim=-1)
    result = TokenLogprobs(token_id=token_id, logprob=float(logprobs[token_id]))
    if params.logprobs > 0:
        values, ids = torch.topk(logprobs, params.logprobs)
        result.top_token_ids, result.top_logprobs = ids.tolist(), values.tolist()
    return token_id, result


def reference_logits(row: torch.Tensor, chunk: ScheduledChunk) -> torch.Tensor:
    """float32 copy of one row after logit_bias, the min_tokens ban and the penalties."""
    params = chunk.sampling_params
    logits = row.to(torch.float32, copy=True)
    vocab = logits.shape[0]
    for token_id, bias in params.logit_bias.pairs():
        if token_id < vocab:
            logits[token_id] += bias
    if len(chunk.output_token_ids) < params.min_tokens:
        eos = () if params.ignore_eos else tuple(chunk.eos_token_ids)
        for token_id in (*eos, *params.stop_token_ids):
            if token_id < vocab:
                logits[token_id] = float("-inf")
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted({*chunk.prompt_token_ids, *chunk.output_token_ids}))
        seen = seen[seen < vocab]
        scores, penalty = logits[seen], params.repetition_penalty
        logits[seen] = torch.where(scores > 0, scores / penalty, scores * penalty)
    if chunk.output_token_ids and (params.presence_penalty or params.frequency_penalty):
        counts = torch.bincount(torch.tensor(chunk.output_token_ids), minlength=vocab)
        counts = counts[:vocab].to(torch.float32)
        logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(
            torch.float32
        )
    return logits


def reference_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """A copy of one row of logits [V] with -inf where bitmask ([W] int32, xgrammar's layout)
    has token v's bit (bit v % 32 of word v // 32) clear."""
    token_ids = torch.arange(logits.shape[0])
    words = bitmask.to(torch.int64)[token_ids // 32]  # int64: the sign bit is bit 31
    allowed = (words >> (token_ids % 32)) & 1 == 1
    return logits.masked_fill(~allowed, float("-inf"))


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Probabilities over the vocabulary after temperature, top-k, top-p and min-p ([V]).

    The whole vocabulary is sorted once, descending with ties by ascending token id; masses
    are cumsums in that order.
    """
    probs = torch.softmax(logits / params.temperature, dim=-1)
    kept, order = probs.sort(descending=True, stable=True)
    if 0 < params.top_k < kept.shape[0]:
        kept = torch.where(kept < kept[params.top_k - 1], 0.0, kept)  # ties of the k-th stay
        kept = kept / kept.cumsum(0)[-1]
    if params.top_p < 1.0:
        # The smallest prefix whose mass reaches top_p: a token is out once the mass before it
        # already reaches top_p (the first token always stays: top_p > 0).
        kept = kept.masked_fill(kept.cumsum(0) - kept >= params.top_p, 0.0)
    if params.min_p > 0.0:
        kept = kept.masked_fill(kept < params.min_p * kept[0], 0.0)
    kept = kept / kept.cumsum(0)[-1]
    return torch.zeros_like(probs).scatter_(0, order, kept)


def reference_draw(probs: torch.Tensor, uniform: float) -> int:
    """Inverse CDF in ascending token id: the first token whose cumulative probability exceeds
    uniform * total; the last token with probability > 0 if rounding leaves none."""
    cdf = probs.cumsum(0)
    target = torch.tensor(uniform * float(cdf[-1]), dtype=torch.float32)
    token_id = int((cdf <= target).sum())  # cdf never falls: the first cdf > target
    return token_id if token_id < probs.shape[0] else int(probs.nonzero()[-1])
