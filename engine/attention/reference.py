"""Reference paged attention: plain torch, one chunk at a time, written for clarity.

Every faster backend is tested against this one (tests/unit/test_paged_attention.py).
"""

from __future__ import annotations

import torch

from engine.attention.kv_cache import context_slots
from engine.attention.metadata import AttentionMetadata


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
    ) -> torch.Tensor:
        write_kv(key, value, key_cache, value_cache, meta.slot_mapping)
        out = torch.empty_like(query)
        group = query.shape[1] // key.shape[1]
        for chunk in meta.chunks:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            slots = context_slots(chunk.block_table, chunk.context_len, meta.block_size)
            keys = key_cache[slots].repeat_interleave(group, dim=1)  # [context, heads, dim]
            values = value_cache[slots].repeat_interleave(group, dim=1)
            q = query[rows].float().transpose(0, 1)  # [heads, query_len, dim]
            scores = q @ keys.float().permute(1, 2, 0) * scale  # [heads, query_len, context]
            # Query i sits at position start_position + i and sees keys 0..start_position + i.
            query_pos = torch.arange(chunk.query_len) + chunk.start_position
            key_pos = torch.arange(chunk.context_len)
            visible = key_pos[None, :] <= query_pos[:, None]
            scores = scores.masked_fill(~visible, float("-inf"))
            probs = torch.softmax(scores, dim=-1)
            out[rows] = (probs @ values.float().transpose(0, 1)).transpose(0, 1).to(out.dtype)
        return out
