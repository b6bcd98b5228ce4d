"""AttentionMetadata: where each chunk's queries, keys and cache slots live in a flat batch."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class ChunkSpan:
    """One request's chunk inside the flat token batch.

    Tokens [query_start, query_start + query_len) of the batch are this chunk; they sit at
    positions [start_position, start_position + query_len) of the request, and after the KV
    write the request's cache holds context_len = start_position + query_len tokens.
    """

    query_start: int
    query_len: int
    start_position: int
    block_table: list[int]

    @property
    def context_len(self) -> int:
        return self.start_position + self.query_len


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step attention inputs shared by all layers.

    Decode chunks come first: batch rows [0, num_decodes) are one token each.
    decode_block_tables[i] is decode i's block table padded with block 0 to the longest one;
    decode_mask[i, 0, 0, j] is 0 where key position j (< max_blocks * block_size) is real and
    -inf on padding (an additive mask). The prefill chunks (after the decodes) are also given
    as tensors for the native prefill kernel: prefill_spans[c] = (query_start, query_len,
    start_position), prefill_block_tables[c] its block table padded with block 0.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot each new token's K/V goes to
    chunks: list[ChunkSpan]
    num_decodes: int
    decode_block_tables: torch.Tensor | None  # [num_decodes, max_blocks] int64
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, max_blocks * block_size] additive
    decode_context_lens: torch.Tensor | None  # [num_decodes] int64: context_len of each decode
    block_size: int
    prefill_spans: torch.Tensor | None = None  # [num_prefills, 3] int64
    prefill_block_tables: torch.Tensor | None = None  # [num_prefills, max_blocks] int64
