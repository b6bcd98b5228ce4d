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
from engine.attention.reference import visible_keys, write_kv
from engine.sliding_windows import first_visible_key


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
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """sliding_window and softcap as in ReferenceAttention.forward."""
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        outputs = []
        if meta.num_decodes:
            decodes = query[: meta.num_decodes]
            outputs.append(
                self._decode(decodes, key_cache, value_cache, meta, scale, sliding_window, softcap)
            )
        outputs.extend(
            prefill_attention(
                query, key, value, key_cache, value_cache, meta, scale, sliding_window, softcap
            )
        )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _decode(self, query, key_cache, value_cache, meta, scale, sliding_window, softcap):
        """The step's decode rows (the first meta.num_decodes of the batch)."""
        return decode_attention(query, key_cache, value_cache, meta, scale, sliding_window, softcap)


def decode_attention(
    query, key_cache, value_cache, meta, scale, sliding_window=None, softcap=None
) -> torch.Tensor:
    """All decode rows in one call over their gathered, padded contexts (under a window, only
    the blocks from the one holding each row's first visible key)."""
    tables, mask = meta.decode_block_tables, meta.decode_mask
    if sliding_window is not None:
        tables, mask = _window_tables(meta, sliding_window)
    keys = _gather_blocks(key_cache, tables, meta.block_size)
    values = _gather_blocks(value_cache, tables, meta.block_size)
    # GQA without repeating K/V: the `group` query heads that share a kv head become
    # `group` query rows of that kv head (head h reads kv head h // group, as in HF).
    num_decodes, num_heads, head_dim = query.shape
    num_kv_heads = keys.shape[1]
    q = query.view(num_decodes, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = masked_attention(q, keys, values, mask, scale, softcap)
    return out.reshape(num_decodes, num_heads, head_dim)


def _window_tables(meta: AttentionMetadata, sliding_window: int):
    """Decode i's block table from block first_block_i (the one holding its first visible key
    first_key_i = max(0, context_len_i - W): the decode at position context_len_i - 1 sees
    keys j > context_len_i - 1 - W), padded to the longest: [decodes, span] block ids, and the
    additive mask over their span * block_size keys, key u at position
    first_block_i * block_size + u, visible when first_key_i <= position < context_len_i.
    Blocks before first_block_i are not read at all (they may have been freed)."""
    block_size, lens = meta.block_size, meta.decode_context_lens
    first_key = (lens - sliding_window).clamp(min=0)
    first_block = first_key // block_size
    span = int((-(-lens // block_size) - first_block).max())
    index = first_block[:, None] + torch.arange(span)  # past a table: its padding or last block
    tables = meta.decode_block_tables.gather(
        1, index.clamp(max=meta.decode_block_tables.shape[1] - 1)
    )
    key_pos = first_block[:, None] * block_size + torch.arange(span * block_size)
    visible = (key_pos >= first_key[:, None]) & (key_pos < lens[:, None])
    mask = torch.zeros(visible.shape, dtype=meta.decode_mask.dtype)
    return tables, mask.masked_fill_(~visible, float("-inf"))[:, None, None, :]


def masked_attention(
    q, keys, values, mask, scale, softcap, enable_gqa=False, is_causal=False
) -> torch.Tensor:
    """SDPA with an additive or boolean mask (or causal, mask None); with a softcap, the same
    in plain ops (SDPA has no score transform), softmax in float32, with a mask always."""
    if softcap is None:
        return F.scaled_dot_product_attention(
            q,
            keys,
            values,
            attn_mask=mask,
            is_causal=is_causal,
            scale=scale,
            enable_gqa=enable_gqa,
        )
    if enable_gqa and keys.shape[-3] != q.shape[-3]:
        group = q.shape[-3] // keys.shape[-3]
        keys = keys.repeat_interleave(group, dim=-3)
        values = values.repeat_interleave(group, dim=-3)
    scores = (q.float() @ keys.float().transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    if mask is not None:
        if mask.dtype == torch.bool:
            scores = scores.masked_fill(~mask, float("-inf"))
        else:
            scores = scores + mask
    probs = torch.softmax(scores, dim=-1)
    return (probs @ values.float()).to(q.dtype)


def prefill_attention(
    query, key, value, key_cache, value_cache, meta, scale, sliding_window=None, softcap=None
) -> list[torch.Tensor]:
    """Outputs of the step's prefill chunks (those after the decodes), in batch order.

    Adjacent whole prompts of equal length share one batched SDPA call (plain causal layers
    only); every other chunk is one call of its own.
    """
    outputs = []
    plain = sliding_window is None and softcap is None
    for group in _fresh_groups(meta.chunks[meta.num_decodes :]):
        if len(group) > 1 and plain:
            outputs.append(_fresh_prefill_group(query, key, value, group, scale))
        else:
            outputs.extend(
                prefill_chunk_attention(
                    query,
                    key,
                    value,
                    key_cache,
                    value_cache,
                    chunk,
                    meta,
                    scale,
                    sliding_window,
                    softcap,
                )
                for chunk in group
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


def prefill_chunk_attention(
    query,
    key,
    value,
    key_cache,
    value_cache,
    chunk,
    meta,
    scale,
    sliding_window=None,
    softcap=None,
):
    """One prefill chunk's attention as one SDPA call; query/key/value are the whole step's."""
    rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
    q = query[rows].transpose(0, 1).unsqueeze(0)  # [1, heads, query_len, dim]
    # Keys [first, context_len): from the first query's window on (blocks before it may have
    # been freed, so they are not read).
    first = first_visible_key(chunk.start_position, sliding_window)
    if chunk.start_position == 0:
        keys, values = key[rows], value[rows]
    else:
        slots = context_slots(chunk.block_table, chunk.context_len, meta.block_size)[first:]
        keys, values = key_cache[slots], value_cache[slots]
    if chunk.start_position == 0 and sliding_window is None and softcap is None:
        mask, causal = None, True
    else:
        query_pos = torch.arange(chunk.query_len) + chunk.start_position
        mask = visible_keys(query_pos, chunk.context_len, sliding_window, first)
        causal = False
    out = masked_attention(
        q,
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        mask,
        scale,
        softcap,
        enable_gqa=True,
        is_causal=causal,
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
