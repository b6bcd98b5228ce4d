"""Batched paged attention for CPUs: all decodes in one SDPA call, prefills by SDPA as well.

Decode is where batching pays (many rows, one token each): their contexts are gathered from
the cache into one padded [batch, max_context] tensor with a mask. Prefill chunks are few and
compute-bound; each runs as one SDPA call (adjacent whole prompts of equal length as one
batched call), reading K/V straight from the step's projections when the chunk starts at
position 0 (no gather needed).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.kv_cache import context_slots
from engine.attention.metadata import AttentionMetadata, ChunkSpan
from engine.attention.reference import write_kv


class BatchedAttention:
    name = "batched"

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
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        outputs = []
        if meta.num_decodes:
            outputs.append(
                self._decode(query[: meta.num_decodes], key_cache, value_cache, meta, scale)
            )
        outputs.extend(prefill_attention(query, key, value, key_cache, value_cache, meta, scale))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    @staticmethod
    def _decode(query, key_cache, value_cache, meta, scale) -> torch.Tensor:
        keys = _gather_blocks(key_cache, meta.decode_block_tables, meta.block_size)
        values = _gather_blocks(value_cache, meta.decode_block_tables, meta.block_size)
        # GQA without repeating K/V: the `group` query heads that share a kv head become
        # `group` query rows of that kv head (head h reads kv head h // group, as in HF).
        num_decodes, num_heads, head_dim = query.shape
        num_kv_heads = keys.shape[1]
        q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q, keys, values, attn_mask=meta.decode_mask, scale=scale
        )
        return out.reshape(num_decodes, num_heads, head_dim)


def prefill_attention(query, key, value, key_cache, value_cache, meta, scale) -> list[torch.Tensor]:
    """Outputs of the step's prefill chunks (those after the decodes), in batch order.

    Adjacent whole prompts of equal length share one batched SDPA call; every other chunk is
    one call of its own.
    """
    outputs = []
    for group in _fresh_groups(meta.chunks[meta.num_decodes :]):
        if len(group) > 1:
            outputs.append(_fresh_prefill_group(query, key, value, group, scale))
        else:
            outputs.append(
                prefill_chunk_attention(
                    query, key, value, key_cache, value_cache, group[0], meta, scale
                )
            )
    return outputs


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


def prefill_chunk_attention(query, key, value, key_cache, value_cache, chunk, meta, scale):
    """One prefill chunk's attention as one SDPA call; query/key/value are the whole step's."""
    rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
    q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
    if chunk.start_position == 0:
        keys, values, mask, causal = key[rows], value[rows], None, True
    else:
        slots = context_slots(chunk.block_table, chunk.context_len, meta.block_size)
        keys, values = key_cache[slots], value_cache[slots]
        query_pos = torch.arange(chunk.query_len) + chunk.start_position
        mask = torch.arange(chunk.context_len)[None, :] <= query_pos[:, None]
        causal = False
    out = F.scaled_dot_product_attention(
        q,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def _gather_blocks(
    cache: torch.Tensor, block_tables: torch.Tensor, block_size: int
) -> torch.Tensor:
    """[slots, kv_heads, dim] cache -> [decodes, kv_heads, max_blocks * block_size, dim].

    Copies whole blocks (block_size contiguous rows each) with one index_select: several
    times faster than gathering slot by slot.
    """
    num_decodes, max_blocks = block_tables.shape
    blocks = cache.view(-1, block_size, *cache.shape[1:])
    gathered = blocks.index_select(0, block_tables.reshape(-1))
    return gathered.view(num_decodes, max_blocks * block_size, *cache.shape[1:]).transpose(1, 2)
