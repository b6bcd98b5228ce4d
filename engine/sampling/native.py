"""Sampled rows through the native kernels (kernels/csrc/sampling.cpp): temperature, top-k,
top-p, min-p and the draw without a float32 copy, softmax or topk over the vocabulary.

The rules are truncation.py's; only where the probabilities come from differs:
  rows with top-k or top-p  the kernel returns each row's K largest scaled logits x (by
                            descending x, ties by ascending id), the row's max and the sum of
                            e^(x - max); their probabilities e^(x - max) / sum go through
                            truncation.truncate, which also says whether K was enough. Rows
                            that needed more try again with more (64 -> 256 -> 1024 -> 4096),
                            then the plain torch path (truncation.choose over a softmax);
  the other rows            one kernel call per row set: e^(x - max) weights, min-p zeroing and
                            an inverse-CDF draw over the whole vocabulary.
Probabilities differ from torch.softmax's by float rounding (the kernel's exp and summation
order), so a draw can differ from the torch path's only when its uniform falls within rounding
of a boundary between two tokens' cumulative masses; tests/unit/test_native_sampling.py checks
both against the same definition.
"""

from __future__ import annotations

import torch

from engine.sampling.truncation import (
    choose_from_logits,
    inverse_cdf,
    next_count,
    select_rows,
    truncate,
)
from scheduler.sampling_params import SamplingParams


def usable(logits: torch.Tensor, kernels) -> bool:
    """Whether the kernels can read these logits in place."""
    return (
        kernels is not None
        and logits.dim() == 2
        and logits.is_contiguous()
        and logits.dtype in (torch.float32, torch.bfloat16)
    )


def choose_native(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    uniforms: torch.Tensor,
    kernels,
) -> torch.Tensor:
    """Token ids [len(rows)]: row rows[i] of logits (before temperature) drawn with params[i]
    and uniforms[i] (float64 in [0, 1)). The logits are read, never written."""
    vocab = logits.shape[1]
    temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32)
    token_ids = torch.empty(len(rows), dtype=torch.long)
    top_k = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    selected = [i for i, p in enumerate(params) if top_k[i] or p.top_p < 1.0]
    whole = sorted(set(range(len(params))) - set(selected))
    if whole:
        token_ids[whole] = kernels.draw_whole(
            logits,
            torch.tensor([rows[i] for i in whole], dtype=torch.long),
            temperature[whole],
            torch.tensor([params[i].min_p for i in whole], dtype=torch.float32),
            uniforms[whole].to(torch.float64).contiguous(),
        )
    pending = {i: next_count(top_k[i], vocab) for i in selected}
    while pending:
        count = min(pending.values())
        group = sorted(i for i, c in pending.items() if c == count)
        if count >= vocab:  # no candidate count was enough: the whole row, torch path
            whole_rows = select_rows(logits, [rows[i] for i in group]).to(torch.float32, copy=True)
            token_ids[group] = choose_from_logits(
                whole_rows, [params[i] for i in group], uniforms[group]
            )
            break
        chosen, complete = _choose_from_candidates(
            logits, rows, params, top_k, temperature, uniforms, group, count, kernels
        )
        for i, token_id, done in zip(group, chosen, complete, strict=True):
            if done:
                token_ids[i] = token_id
                del pending[i]
            else:
                pending[i] = next_count(count, vocab)
    return token_ids


def _choose_from_candidates(
    logits: torch.Tensor,
    rows: list[int],
    params: list[SamplingParams],
    top_k: list[int],
    temperature: torch.Tensor,
    uniforms: torch.Tensor,
    group: list[int],
    count: int,
    kernels,
) -> tuple[list[int], list[bool]]:
    """Draws for `group` (indices into rows) from their `count` largest candidates; a row whose
    complete flag is False must be redone with more (its token is meaningless)."""
    index = torch.tensor([rows[i] for i in group], dtype=torch.long)
    row_max, total, values, ids = kernels.top_candidates(logits, index, temperature[group], count)
    descending = torch.exp(values - row_max[:, None]) / total[:, None]
    token_ids, by_id = ids.sort(dim=1, stable=True)
    # order[i, j] = column (in ascending id) of the j-th largest: the inverse of by_id.
    positions = torch.arange(count).expand(len(group), -1)
    order = torch.empty_like(by_id).scatter_(1, by_id, positions)
    candidates, complete = truncate(
        list(range(len(group))),
        descending,
        order,
        token_ids,
        [top_k[i] for i in group],
        [params[i] for i in group],
        logits.shape[1],
    )
    chosen = torch.zeros(len(group), dtype=torch.long)
    if candidates.rows.numel():
        local = torch.tensor(group)[candidates.rows]
        positions = inverse_cdf(candidates.weights, uniforms[local])
        chosen[candidates.rows] = candidates.token_ids.gather(1, positions[:, None]).squeeze(1)
    return chosen.tolist(), complete
