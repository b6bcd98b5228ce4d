"""Paged attention on the native CPU kernels: decodes read K/V in place, no gather copy.

The step's new K/V go to their slots with one kernel call per layer; every decode row then
attends over its own block table (engine/kernels/csrc/paged_attention.cpp), so a short
request does not pay for the longest one's padding. Prefill chunks are compute-bound and go
through SDPA as in BatchedAttention, except that adjacent whole prompts of equal length share
one batched call. Tested against ReferenceAttention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.batched import prefill_chunk_attention
from engine.attention.metadata import AttentionMetadata, ChunkSpan


class CpuKernelAttention:
    name = "cpu_kernels"

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def forward(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        num_tokens = key.shape[0]
        self.kernels.store_kv_(
            key.reshape(num_tokens, -1),
            value.reshape(num_tokens, -1),
            key_cache,
            value_cache,
            meta.slot_mapping,
        )
        outputs = []
        if meta.num_decodes:
            outputs.append(
                self.kernels.paged_decode_attention(
                    query[: meta.num_decodes],
                    key_cache,
                    value_cache,
                    meta.decode_block_tables,
                    meta.decode_context_lens,
                    meta.block_size,
                    scale,
                )
            )
        for group in _fresh_groups(meta.chunks[meta.num_decodes :]):
            if len(group) > 1:
                outputs.append(_fresh_prefill_group(query, key, value, group, scale))
            else:
                outputs.append(
                    prefill_chunk_attention(
                        query, key, value, key_cache, value_cache, group[0], meta, scale
                    )
                )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _fresh_groups(chunks: list[ChunkSpan]) -> list[list[ChunkSpan]]:
    """Runs of adjacent chunks that start at position 0 with the same length, in order; any
    other chunk is a run of its own. A run's rows are contiguous in the batch."""
    groups: list[list[ChunkSpan]] = []
    for chunk in chunks:
        last = groups[-1][-1] if groups else None
        if (
            last is not None
            and chunk.start_position == last.start_position == 0
            and chunk.query_len == last.query_len
        ):
            groups[-1].append(chunk)
        else:
            groups.append([chunk])
    return groups


def _fresh_prefill_group(query, key, value, group: list[ChunkSpan], scale: float) -> torch.Tensor:
    """G whole prompts of L tokens each as one batched causal SDPA call (one call per prompt
    costs more in overhead than in arithmetic at these sizes: 16 calls per layer per step in
    the offline benchmark). Rows [first.query_start, first.query_start + G * L)."""
    count, length = len(group), group[0].query_len
    rows = slice(group[0].query_start, group[0].query_start + count * length)

    def batched(x: torch.Tensor) -> torch.Tensor:  # [G * L, heads, dim] -> [G, heads, L, dim]
        return x[rows].unflatten(0, (count, length)).transpose(1, 2)

    out = F.scaled_dot_product_attention(
        batched(query), batched(key), batched(value), is_causal=True, scale=scale, enable_gqa=True
    )
    return out.transpose(1, 2).flatten(0, 1)
