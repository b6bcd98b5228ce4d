"""Truncation and the draw: probabilities of the sampled rows -> kept tokens -> one token each.

Per row, in this order (the same float operations as reference.reference_probs):
  top-k  keep probabilities >= the k-th largest (every tie of the k-th stays), renormalize;
  top-p  in descending probability order, ties by ascending token id (a stable sort), drop a
         token once the mass before it reaches top_p;
  min-p  drop probabilities < min_p * the largest; renormalize.
Masses are cumsums in that descending order (torch's CPU cumsum accumulates in float64), so a
row's result depends neither on the other rows nor on how many candidates were looked at.

Each filter keeps a prefix of the descending order, so a row needs only its largest
probabilities: torch.topk of K candidates is exact once the smallest kept probability (and
with top-k the k-th largest, whose ties all enter its renormalization) is strictly above the
K-th candidate's: then every token at or above it is a candidate, ties included. Rows where it is not try again with more (64 -> 256 -> 1024 -> 4096), then sort the
whole vocabulary. Rows with neither top-k nor top-p skip the selection: min-p alone is a
threshold on the whole vocabulary.

The draw is an inverse CDF over the kept tokens in ascending token id: the row's uniform u
picks the first token whose cumulative weight exceeds u * total weight.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from scheduler.sampling_params import SamplingParams

CANDIDATE_COUNTS = (64, 256, 1024, 4096)  # then the whole vocabulary


@dataclass(frozen=True, slots=True)
class Candidates:
    """The kept tokens of some rows: tensor row i belongs to batch row rows[i].

    token_ids ascend along dim 1. weights[i, j] is proportional to the probability of
    token_ids[i, j] (0 = dropped): normalized for selected rows, the min-p-masked softmax for
    whole-vocabulary rows (the draw does not need the division).
    """

    rows: torch.Tensor  # [n] int64
    token_ids: torch.Tensor  # [n, K] int64
    weights: torch.Tensor  # [n, K] float32


def choose(
    probs: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """probs [R, V]: softmax of row i's scaled logits; params[i], uniforms[i] (float64 in
    [0, 1)) belong to row i. Returns the chosen token ids, [R] int64."""
    token_ids = torch.empty(probs.shape[0], dtype=torch.long)
    for group in kept_tokens(probs, params):
        positions = inverse_cdf(group.weights, uniforms[group.rows])
        token_ids[group.rows] = group.token_ids.gather(1, positions[:, None]).squeeze(1)
    return token_ids


def choose_from_logits(
    logits: torch.Tensor, params: list[SamplingParams], uniforms: torch.Tensor
) -> torch.Tensor:
    """choose() from float32 logits [R, V] before temperature; they are divided by it in place
    (pass rows the caller may overwrite)."""
    logits /= torch.tensor([p.temperature for p in params])[:, None]
    return choose(torch.softmax(logits, dim=-1), params, uniforms)


def kept_tokens(probs: torch.Tensor, params: list[SamplingParams]) -> list[Candidates]:
    """Every row of probs [R, V] appears in exactly one of the returned groups."""
    vocab = probs.shape[1]
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    selected = [i for i, p in enumerate(params) if top_k[i] or p.top_p < 1.0]
    whole = sorted(set(range(len(params))) - set(selected))
    groups = [_whole_vocabulary(probs, whole, params)] if whole else []
    # Each row starts at the fewest candidates that hold its top_k and a tie of its k-th.
    counts = {i: next_count(top_k[i], vocab) for i in selected}
    while counts:
        count = min(counts.values())
        rows = sorted(i for i, c in counts.items() if c == count)
        group, complete = _candidates(probs, rows, count, top_k, params)
        if any(complete):
            groups.append(group)
        for i, done in zip(rows, complete, strict=True):
            if done:
                del counts[i]
            else:
                counts[i] = next_count(count, vocab)
    return groups


def next_count(more_than: int, vocab: int) -> int:
    return min([c for c in CANDIDATE_COUNTS if c > more_than and c < vocab] + [vocab])


def inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Position along dim 1 of the first cumulative weight > u * total, per row ([n] int64).

    Only a position with weight > 0 can come out: the cumulative weight rises only there.
    """
    cdf = weights.cumsum(dim=1)
    target = (uniforms.to(torch.float64) * cdf[:, -1].to(torch.float64)).to(torch.float32)
    positions = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)
    overflow = positions >= weights.shape[1]
    if bool(overflow.any()):  # u * total rounded up to total: the last kept token is meant
        last = weights.shape[1] - 1 - (weights > 0).flip(1).to(torch.uint8).argmax(dim=1)
        positions = torch.where(overflow, last, positions)
    return positions


def _whole_vocabulary(
    probs: torch.Tensor, rows: list[int], params: list[SamplingParams]
) -> Candidates:
    weights = select_rows(probs, rows)
    min_p = [params[i].min_p for i in rows]
    if any(min_p):
        threshold = torch.tensor(min_p)[:, None] * weights.amax(dim=1, keepdim=True)
        weights = weights.masked_fill(weights < threshold, 0.0)
    token_ids = torch.arange(probs.shape[1]).expand(len(rows), -1)
    return Candidates(torch.tensor(rows), token_ids, weights)


def _candidates(
    probs: torch.Tensor, rows: list[int], count: int, top_k: list[int], params: list[SamplingParams]
) -> tuple[Candidates, list[bool]]:
    """The `count` largest probabilities of `rows`, filtered; complete[i]: row rows[i] is exact."""
    subset = select_rows(probs, rows)
    vocab = probs.shape[1]
    if count < vocab:
        values, token_ids = subset.topk(count, dim=1)  # the order of equal values is unspecified
        token_ids, by_id = token_ids.sort(dim=1)
        values = values.gather(1, by_id)
        descending, order = values.sort(dim=1, descending=True, stable=True)
    else:
        descending, order = subset.sort(dim=1, descending=True, stable=True)
        token_ids = torch.arange(vocab).expand(len(rows), -1)
    return truncate(
        rows,
        descending,
        order,
        token_ids,
        [top_k[i] for i in rows],
        [params[i] for i in rows],
        vocab,
    )


def truncate(
    rows: list[int],
    descending: torch.Tensor,
    order: torch.Tensor,
    token_ids: torch.Tensor,
    top_k: list[int],
    params: list[SamplingParams],
    vocab: int,
) -> tuple[Candidates, list[bool]]:
    """Top-k, top-p and min-p over candidate probabilities: descending [n, K] (row i belongs to
    batch row rows[i], params[i], top_k[i]) in descending order, ties by ascending token id;
    token_ids [n, K] ascending; order[i, j]: column in token_ids of row i's j-th largest.
    complete[i]: row i's result is exact (it did not need a token beyond the K candidates)."""
    row_top_k = torch.tensor(top_k)
    kept = _filter(
        descending,
        row_top_k,
        torch.tensor([p.top_p if p.top_p < 1.0 else math.inf for p in params]),
        torch.tensor([p.min_p for p in params]),
    )
    # Exact when every token the filters looked at is a candidate: the kept ones, and for
    # top-k every tie of the k-th (its renormalization sums them all).
    num_kept = (kept > 0).sum(dim=1, keepdim=True).clamp(min=1)
    smallest_seen = descending.gather(1, num_kept - 1)
    kth = descending.gather(1, (row_top_k - 1).clamp(min=0)[:, None])
    smallest_seen = torch.where(row_top_k[:, None] > 0, smallest_seen.minimum(kth), smallest_seen)
    every_token = descending.shape[1] == vocab
    complete = (smallest_seen > descending[:, -1:]).squeeze(1) | every_token
    weights = torch.zeros_like(kept).scatter_(1, order, kept)
    done = complete.nonzero().squeeze(1)
    group = Candidates(torch.tensor(rows)[done], token_ids[done], weights[done])
    return group, complete.tolist()


def _filter(
    descending: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """descending [n, K] probabilities; top_k [n] (0 = off), top_p [n] (inf = off), min_p [n]
    (0 = off). Returns the final probabilities in the same order, 0 where dropped."""
    kept = descending
    if bool((top_k > 0).any()):
        on = (top_k > 0)[:, None]
        kth = descending.gather(1, (top_k - 1).clamp(min=0)[:, None])
        kept = torch.where(on & (kept < kth), 0.0, kept)
        kept = torch.where(on, kept / _total(kept), kept)
    if bool((top_p < math.inf).any()):
        mass_before = kept.cumsum(dim=1) - kept
        kept = kept.masked_fill(mass_before >= top_p[:, None], 0.0)
    if bool((min_p > 0).any()):
        kept = kept.masked_fill(kept < min_p[:, None] * kept[:, :1], 0.0)
    return kept / _total(kept)


def _total(values: torch.Tensor) -> torch.Tensor:
    """Sum along dim 1 in column order (float64 accumulation), [n, 1]."""
    return values.cumsum(dim=1)[:, -1:]


def select_rows(values: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """values[rows] (a copy), or values itself when rows are all of them in order."""
    if rows == list(range(values.shape[0])):
        return values
    return values.index_select(0, torch.tensor(rows, dtype=torch.long))
