"""Input preparation: SchedulerOutput -> ForwardBatch (ids, positions, slots, block tables).

Built as Python lists first (pure, unit-tested against hand-computed values in
tests/unit/test_forward_batch.py), then turned into tensors in exactly one place.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata, ChunkSpan
from scheduler.output import ScheduledChunk


@dataclass(slots=True)
class BatchLists:
    """The step's inputs as plain lists. Index ranges follow the chunks' order."""

    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]
    spans: list[ChunkSpan]
    # Batch rows sampled: each sampling chunk's last known token, then its drafts' rows.
    sample_rows: list[int]
    num_decodes: int  # leading chunks that are single-token decodes


def slot_of(block_table: list[int], position: int, block_size: int) -> int:
    return block_table[position // block_size] * block_size + position % block_size


def build_lists(
    chunks: list[ScheduledChunk], block_size: int, rows_as_decodes: bool = False
) -> BatchLists:
    """Flatten chunks into one token batch.

    chunk c owns batch rows [query_start_c, query_start_c + len(c.token_ids)), and its tokens
    sit at request positions [c.start_position, c.start_position + len(c.token_ids)).
    rows_as_decodes (the batch-invariant mode, engine/batch_invariance.py): every row is a
    one-token span, attended as a decode of its own (context = its position + 1), so a row's
    attention is the same in a prompt chunk of any length, a recompute or a decode.
    """
    lists = BatchLists([], [], [], [], [], 0)
    for chunk in chunks:
        query_start = len(lists.input_ids)
        n = len(chunk.token_ids)
        positions = range(chunk.start_position, chunk.start_position + n)
        lists.input_ids.extend(chunk.token_ids)
        lists.positions.extend(positions)
        lists.slot_mapping.extend(slot_of(chunk.block_table, p, block_size) for p in positions)
        if rows_as_decodes or (chunk.draft_token_ids and chunk.is_decode):
            # A decode with drafts is n one-token decodes of the same request: row j attends up
            # to its own position, whose K/V the step writes before any row attends.
            lists.spans.extend(
                ChunkSpan(query_start + j, 1, p, chunk.block_table) for j, p in enumerate(positions)
            )
        else:
            lists.spans.append(ChunkSpan(query_start, n, chunk.start_position, chunk.block_table))
        if chunk.samples:  # rows [end - 1 - drafts, end): the last known token, the drafts
            end = query_start + n
            lists.sample_rows.extend(range(end - chunk.num_sample_rows, end))
    lists.num_decodes = _count_leading_decodes(lists.spans)
    return lists


def _count_leading_decodes(spans: list[ChunkSpan]) -> int:
    count = 0
    for span in spans:
        if span.query_len != 1:
            break
        count += 1
    return count


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    sample_rows: torch.Tensor


def to_tensors(
    lists: BatchLists, block_size: int, dtype: torch.dtype = torch.float32
) -> ForwardBatch:
    """The one place the step's lists become tensors (plus the decode gather index).

    The decode mask is additive (0 or -inf, in the model's dtype), built once per step rather
    than converted from a boolean mask in every layer.
    """
    decodes = lists.spans[: lists.num_decodes]
    block_tables, visible = _decode_gather(decodes, block_size)
    mask = None
    if visible is not None:
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(lists.slot_mapping, dtype=torch.long),
        chunks=lists.spans,
        num_decodes=lists.num_decodes,
        decode_block_tables=block_tables,
        decode_mask=mask,
        decode_context_lens=(
            torch.tensor([s.context_len for s in decodes], dtype=torch.long) if decodes else None
        ),
        block_size=block_size,
    )
    prefills = lists.spans[lists.num_decodes :]
    if prefills:
        meta.prefill_spans = torch.tensor(
            [(s.query_start, s.query_len, s.start_position) for s in prefills], dtype=torch.long
        )
        meta.prefill_block_tables = _padded_tables(prefills)
    return ForwardBatch(
        input_ids=torch.tensor(lists.input_ids, dtype=torch.long),
        positions=torch.tensor(lists.positions, dtype=torch.long),
        meta=meta,
        sample_rows=torch.tensor(lists.sample_rows, dtype=torch.long),
    )


def _decode_gather(spans: list[ChunkSpan], block_size: int):
    """Block ids of every decode's context, padded to the longest table: [decodes, max_blocks].

    The mask covers max_blocks * block_size key positions; position j of decode i is visible
    when j < context_len_i (padding blocks point at block 0 and are masked out).
    """
    if not spans:
        return None, None
    tables = _padded_tables(spans)
    max_blocks = tables.shape[1]
    context_lens = torch.tensor([s.context_len for s in spans])
    positions = torch.arange(max_blocks * block_size)
    mask = positions[None, :] < context_lens[:, None]
    return tables, mask[:, None, None, :]


def _padded_tables(spans: list[ChunkSpan]) -> torch.Tensor:
    """The spans' block tables padded with block 0 to the longest: [spans, max_blocks] int64."""
    max_blocks = max(len(s.block_table) for s in spans)
    return torch.tensor(
        [s.block_table + [0] * (max_blocks - len(s.block_table)) for s in spans], dtype=torch.long
    )
