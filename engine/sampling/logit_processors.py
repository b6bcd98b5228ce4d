"""Logit processors, batched: logits of the processed rows -> a float32 copy with, per row,
logit_bias added, EOS/stop ids banned until min_tokens, then repetition, presence and
frequency penalties (the order and float operations of reference.reference_logits).

Each processor gathers its rows' (row, token id[, value]) triples into flat tensors and
scatters them into the copy in one indexing call; only the rows that use it contribute.
"""

from __future__ import annotations

from array import array

import torch

from scheduler.output import ScheduledChunk, TokenLogprobs


def needs_processing(chunk: ScheduledChunk) -> bool:
    """False for plain greedy rows: those take the argmax of the model's logits as they are."""
    return not chunk.sampling_params.greedy or _processed_or_reported(chunk)


def samples_only(chunk: ScheduledChunk) -> bool:
    """A sampled row whose logits need no processor, logprobs or grammar: temperature and the
    truncation filters are all it needs."""
    params = chunk.sampling_params
    return (
        not params.greedy and params.structured_output is None and not _processed_or_reported(chunk)
    )


def _processed_or_reported(chunk: ScheduledChunk) -> bool:
    """The row's logits go through a processor (bias, min_tokens ban, penalties) or its
    logprobs are reported."""
    params = chunk.sampling_params
    return (
        params.logprobs is not None
        or params.uses_penalties
        or bool(params.logit_bias)
        or len(chunk.output_token_ids) < params.min_tokens
    )


def processed_logits(
    logits: torch.Tensor, rows: list[int], chunks: list[ScheduledChunk]
) -> torch.Tensor:
    """float32 copy of logits[rows] ([len(rows), V]) with the processors applied; chunks[i]
    belongs to logits row rows[i]. The model's logits are not written."""
    if rows == list(range(logits.shape[0])):
        work = logits.to(torch.float32, copy=True)
    else:  # index_select copies already; to() copies again only to widen
        work = logits.index_select(0, torch.tensor(rows, dtype=torch.long)).to(torch.float32)
    _add_logit_bias(work, chunks)
    _ban_until_min_tokens(work, chunks)
    _apply_repetition_penalty(work, chunks)
    _apply_presence_and_frequency_penalties(work, chunks)
    return work


def _add_logit_bias(work: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    """One index_add per biased row, straight from the bias's arrays (no per-entry loop)."""
    vocab = work.shape[1]
    for row, chunk in enumerate(chunks):
        bias = chunk.sampling_params.logit_bias
        count = bias.num_below(vocab)
        if count:
            token_ids = torch.frombuffer(bias.token_ids, dtype=torch.int64, count=count)
            values = torch.frombuffer(bias.values, dtype=torch.float32, count=count)
            work[row].index_add_(0, token_ids, values)


def _ban_until_min_tokens(work: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    vocab = work.shape[1]
    pairs = []
    for row, chunk in enumerate(chunks):
        params = chunk.sampling_params
        if len(chunk.output_token_ids) < params.min_tokens:
            eos = () if params.ignore_eos else tuple(chunk.eos_token_ids)
            pairs += [(row, t) for t in (*eos, *params.stop_token_ids) if t < vocab]
    if pairs:
        rows, token_ids = zip(*pairs, strict=True)
        work[torch.tensor(rows), torch.tensor(token_ids)] = float("-inf")


def _apply_repetition_penalty(work: torch.Tensor, chunks: list[ScheduledChunk]) -> None:
    """Hugging Face's rule, over prompt and output tokens: divide positive logits by the
    penalty, multiply negative ones. A token seen twice is listed twice: both writes store the
    same value, computed from the logits before any write."""
    rows = [r for r, c in enumerate(chunks) if c.sampling_params.repetition_penalty != 1.0]
    if not rows:
        return
    penalty = torch.ones(work.shape[0])
    penalty[rows] = torch.tensor([chunks[r].sampling_params.repetition_penalty for r in rows])
    seen = [chunks[r].prompt_token_ids + chunks[r].output_token_ids for r in rows]
    row_index, token_index = _pairs(rows, seen, work.shape[1])
    scores, penalty = work[row_index, token_index], penalty[row_index]
    work[row_index, token_index] = torch.where(scores > 0, scores / penalty, scores * penalty)


def _apply_presence_and_frequency_penalties(
    work: torch.Tensor, chunks: list[ScheduledChunk]
) -> None:
    """OpenAI's definition, over output tokens: logit -= frequency * count + presence."""
    rows = [
        r
        for r, c in enumerate(chunks)
        if c.output_token_ids
        and (c.sampling_params.presence_penalty or c.sampling_params.frequency_penalty)
    ]
    if not rows:
        return
    frequency, presence = torch.zeros(work.shape[0]), torch.zeros(work.shape[0])
    frequency[rows] = torch.tensor([chunks[r].sampling_params.frequency_penalty for r in rows])
    presence[rows] = torch.tensor([chunks[r].sampling_params.presence_penalty for r in rows])
    vocab = work.shape[1]
    row_index, token_index = _pairs(rows, [chunks[r].output_token_ids for r in rows], vocab)
    keys, counts = (row_index * vocab + token_index).unique(return_counts=True)
    row_index, token_index = keys // vocab, keys % vocab
    penalty = frequency[row_index] * counts.to(torch.float32) + presence[row_index]
    work[row_index, token_index] = work[row_index, token_index] - penalty


def _pairs(
    rows: list[int], token_ids: list[list[int]], vocab: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat (row, token id) index tensors: rows[i] once per id in token_ids[i]; ids >= vocab
    (no logit to touch) are dropped."""
    flat = array("q")  # one C-level copy per list: torch.tensor(list) is ~10x slower here
    for ids in token_ids:
        flat.extend(ids)
    token_index = (
        torch.frombuffer(flat, dtype=torch.int64) if flat else torch.empty(0, dtype=torch.long)
    )
    lengths = torch.tensor([len(ids) for ids in token_ids])
    row_index = torch.tensor(rows).repeat_interleave(lengths)
    keep = token_index < vocab
    return row_index[keep], token_index[keep]


def token_logprobs(
    logprobs: torch.Tensor, token_ids: list[int], tops: list[int]
) -> list[TokenLogprobs]:
    """logprobs [n, V] (log_softmax of processed rows); row i chose token_ids[i] and asks for
    its tops[i] most likely alternatives."""
    chosen = logprobs.gather(1, torch.tensor(token_ids)[:, None]).squeeze(1).tolist()
    most = max(tops)
    top_values: list[list[float]] = [[] for _ in tops]
    top_ids: list[list[int]] = [[] for _ in tops]
    if most > 0:
        values, ids = torch.topk(logprobs, most, dim=1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprobs(
            token_id=token_id,
            logprob=logprob,
            top_token_ids=top_ids[i][:top] if top > 0 else [],
            top_logprobs=top_values[i][:top] if top > 0 else [],
        )
        for i, (token_id, logprob, top) in enumerate(zip(token_ids, chosen, tops, strict=True))
    ]
