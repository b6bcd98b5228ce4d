"""forward_batch: a mixed step's flat inputs against values worked out by hand (block_size 4).

The step, in the scheduler's order (decodes first):
  A  decode   position 5,        block_table [7, 2]      -> slot 2*4+1 = 9,  context 6
  B  decode   position 9,        block_table [3, 0, 5]   -> slot 5*4+1 = 21, context 10
  C  prefill  positions 3..6 of a 10-token prompt (mid-prompt chunk, samples nothing),
              block_table [4, 6] -> slots 4*4+3 = 19, then 6*4+0.. = 24, 25, 26
  D  prefill  positions 0..2 of a fresh 3-token prompt, block_table [1] -> slots 4, 5, 6

Batch rows: A = 0, B = 1, C = 2..5, D = 6..8.
"""

from __future__ import annotations

import torch

from engine.attention.metadata import ChunkSpan
from engine.forward_batch import build_lists, slot_of, to_tensors
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams

BLOCK_SIZE = 4


def _chunk(request_id, token_ids, start, table, samples, num_prompt_tokens) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        token_ids=token_ids,
        start_position=start,
        block_table=table,
        samples=samples,
        num_prompt_tokens=num_prompt_tokens,
        sampling_params=SamplingParams(temperature=0.0),
        prompt_token_ids=[],
        output_token_ids=[],
    )


def _mixed_step() -> list[ScheduledChunk]:
    return [
        _chunk("A", [11], 5, [7, 2], True, 5),
        _chunk("B", [12], 9, [3, 0, 5], True, 8),
        _chunk("C", [20, 21, 22, 23], 3, [4, 6], False, 10),
        _chunk("D", [30, 31, 32], 0, [1], True, 3),
    ]


def test_slot_of_is_block_id_times_block_size_plus_offset() -> None:
    assert slot_of([7, 2], 0, BLOCK_SIZE) == 28
    assert slot_of([7, 2], 3, BLOCK_SIZE) == 31
    assert slot_of([7, 2], 4, BLOCK_SIZE) == 8
    assert slot_of([3, 0, 5], 9, BLOCK_SIZE) == 21


def test_build_lists_for_a_mixed_step() -> None:
    lists = build_lists(_mixed_step(), BLOCK_SIZE)
    assert lists.input_ids == [11, 12, 20, 21, 22, 23, 30, 31, 32]
    assert lists.positions == [5, 9, 3, 4, 5, 6, 0, 1, 2]
    assert lists.slot_mapping == [9, 21, 19, 24, 25, 26, 4, 5, 6]
    assert lists.sample_rows == [0, 1, 8]  # C samples nothing: its chunk ends mid-prompt
    assert lists.num_decodes == 2
    assert lists.spans == [
        ChunkSpan(0, 1, 5, [7, 2]),
        ChunkSpan(1, 1, 9, [3, 0, 5]),
        ChunkSpan(2, 4, 3, [4, 6]),
        ChunkSpan(6, 3, 0, [1]),
    ]
    assert [span.context_len for span in lists.spans] == [6, 10, 7, 3]


def test_to_tensors_decode_block_tables_and_mask() -> None:
    batch = to_tensors(build_lists(_mixed_step(), BLOCK_SIZE), BLOCK_SIZE)
    assert batch.input_ids.tolist() == [11, 12, 20, 21, 22, 23, 30, 31, 32]
    assert batch.positions.tolist() == [5, 9, 3, 4, 5, 6, 0, 1, 2]
    assert batch.sample_rows.tolist() == [0, 1, 8]
    meta = batch.meta
    assert meta.slot_mapping.dtype == torch.long
    assert meta.slot_mapping.tolist() == [9, 21, 19, 24, 25, 26, 4, 5, 6]
    assert meta.num_decodes == 2 and meta.block_size == BLOCK_SIZE
    # Decode block tables padded with block 0 to the longest (B's three blocks).
    assert meta.decode_block_tables.tolist() == [[7, 2, 0], [3, 0, 5]]
    # 3 blocks = 12 key positions; A sees positions 0..5, B sees 0..9. Additive: 0 or -inf.
    inf = float("-inf")
    assert meta.decode_mask.shape == (2, 1, 1, 12)
    assert meta.decode_mask.dtype == torch.float32
    assert meta.decode_mask[:, 0, 0].tolist() == [
        [0.0] * 6 + [inf] * 6,
        [0.0] * 10 + [inf] * 2,
    ]


def test_decode_mask_takes_the_model_dtype() -> None:
    batch = to_tensors(build_lists(_mixed_step(), BLOCK_SIZE), BLOCK_SIZE, torch.bfloat16)
    assert batch.meta.decode_mask.dtype == torch.bfloat16
    assert batch.meta.decode_mask[0, 0, 0, 5] == 0 and batch.meta.decode_mask[0, 0, 0, 6] == float(
        "-inf"
    )


def test_prefill_only_step_has_no_decode_gather() -> None:
    chunks = [_chunk("D", [30, 31, 32], 0, [1], True, 3)]
    batch = to_tensors(build_lists(chunks, BLOCK_SIZE), BLOCK_SIZE)
    assert batch.meta.num_decodes == 0
    assert batch.meta.decode_block_tables is None and batch.meta.decode_mask is None
    assert batch.sample_rows.tolist() == [2]


def test_recompute_chunk_of_one_token_at_prompt_end_counts_as_decode_row() -> None:
    # A one-token chunk is a decode row for attention (query_len 1) wherever it sits, but a
    # multi-token chunk after it stops the leading-decode count.
    chunks = [
        _chunk("A", [11], 5, [7, 2], True, 5),
        _chunk("C", [20, 21], 0, [4], True, 2),
        _chunk("E", [40], 2, [9], True, 1),
    ]
    lists = build_lists(chunks, BLOCK_SIZE)
    assert lists.num_decodes == 1
    assert lists.sample_rows == [0, 2, 3]
    assert lists.slot_mapping == [9, 16, 17, 38]


def test_tables_with_null_block_placeholders() -> None:
    """Under a sliding window of 8 the KV cache puts the null block 0 where it freed dead
    blocks. The lists carry those entries as they are: new tokens never land in them, and the
    gather / padding treat them as any block (the attention's window masks them).

      E  decode   position 21, table [0, 0, 0, 4, 5, 6] -> slot 6*4+1 = 25, context 22
      F  prefill  positions 16..18, table [0, 0, 3, 7, 8] -> slots 8*4+0.. = 32, 33, 34
    """
    chunks = [
        _chunk("E", [50], 21, [0, 0, 0, 4, 5, 6], True, 10),
        _chunk("F", [60, 61, 62], 16, [0, 0, 3, 7, 8], True, 19),
    ]
    lists = build_lists(chunks, BLOCK_SIZE)
    assert lists.positions == [21, 16, 17, 18]
    assert lists.slot_mapping == [25, 32, 33, 34]
    assert all(slot >= BLOCK_SIZE for slot in lists.slot_mapping)  # never the null block
    assert lists.num_decodes == 1 and lists.sample_rows == [0, 3]
    batch = to_tensors(lists, BLOCK_SIZE)
    meta = batch.meta
    assert meta.decode_block_tables.tolist() == [[0, 0, 0, 4, 5, 6]]
    assert meta.decode_context_lens.tolist() == [22]
    inf = float("-inf")
    assert meta.decode_mask[0, 0, 0].tolist() == [0.0] * 22 + [inf] * 2
    assert meta.prefill_spans.tolist() == [[1, 3, 16]]
    assert meta.prefill_block_tables.tolist() == [[0, 0, 3, 7, 8]]


def test_rows_as_decodes_make_every_row_a_one_token_span() -> None:
    # The batch-invariant mode: C's and D's prompt rows become decodes of their own, each
    # attending up to its own position; rows, positions and slots stay as they were.
    lists = build_lists(_mixed_step(), BLOCK_SIZE, rows_as_decodes=True)
    assert lists.input_ids == [11, 12, 20, 21, 22, 23, 30, 31, 32]
    assert lists.slot_mapping == [9, 21, 19, 24, 25, 26, 4, 5, 6]
    assert lists.sample_rows == [0, 1, 8]
    assert lists.num_decodes == 9
    assert [(s.query_start, s.query_len) for s in lists.spans] == [(r, 1) for r in range(9)]
    assert [s.context_len for s in lists.spans] == [6, 10, 4, 5, 6, 7, 1, 2, 3]
    assert [s.block_table for s in lists.spans] == [[7, 2], [3, 0, 5]] + [[4, 6]] * 4 + [[1]] * 3
