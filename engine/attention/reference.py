"""Reference paged attention: plain torch, one chunk at a time, written for clarity.

Every faster backend is tested against this one (tests/unit/test_paged_attention.py).
"""

from __future__ import annotations

import torch

from engine.attention.kv_cache import context_slots
from engine.attention.metadata import AttentionMetadata
from engine.sliding_windows import first_visible_key


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store this step's new K/V ([num_tokens, num_kv_heads, head_dim]) at their slots."""
    key_cache.index_copy_(0, slot_mapping, key)
    value_cache.index_copy_(0, slot_mapping, value)


def visible_keys(
    query_pos: torch.Tensor, context_len: int, sliding_window: int | None, first_key: int = 0
) -> torch.Tensor:
    """[queries, context_len - first_key] bool over key positions [first_key, context_len): key
    j is visible to the query at position p when j <= p and, under a sliding window W, p - W < j."""
    key_pos = torch.arange(first_key, context_len)[None, :]
    visible = key_pos <= query_pos[:, None]
    if sliding_window is not None:
        visible &= key_pos > query_pos[:, None] - sliding_window
    return visible


class ReferenceAttention:
    """Per chunk: gather its context from the cache, causal softmax attention, GQA by repeat."""

    name = "reference"

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
        """sliding_window W: a query at position i sees keys j with i - W < j <= i (HF's
        sliding-window mask); softcap c: scores become c * tanh(scores / c) before the mask."""
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        group = query.shape[1] // key.shape[1]
        for chunk in meta.chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            # Keys [first, context_len): the first query's window onwards. Keys before it are
            # never read (their blocks may have been freed and replaced).
            first = first_visible_key(chunk.start_position, sliding_window)
            slots = context_slots(chunk.block_table, chunk.context_len, meta.block_size)[first:]
            keys = key_cache[slots].repeat_interleave(group, dim=1)  # [keys, heads, dim]
            values = value_cache[slots].repeat_interleave(group, dim=1)
            q = query[rows].float().transpose(0, 1)  # [heads, query_len, dim]
            scores = q @ keys.float().permute(1, 2, 0) * scale  # [heads, query_len, keys]
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            # Query i sits at position start_position + i and sees keys 0..start_position + i.
            query_pos = torch.arange(chunk.query_len) + chunk.start_position
            visible = visible_keys(query_pos, chunk.context_len, sliding_window, first)
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[rows] = (probs @ values.float().transpose(0, 1)).transpose(0, 1).to(out.dtype)
        return out
