"""Paged attention on the native CPU kernels: decodes read K/V in place, no gather copy.

The step's new K/V go to their slots with one kernel call per layer; every decode row then
attends over its own block table (engine/kernels/csrc/paged_attention.cpp), so a short
request does not pay for the longest one's padding. Prefill chunks are compute-bound and go
through the same SDPA path as in BatchedAttention (prefill_attention). Tested against
ReferenceAttention.
"""

from __future__ import annotations

import torch

from engine.attention.batched import prefill_attention
from engine.attention.metadata import AttentionMetadata


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
        outputs.extend(prefill_attention(query, key, value, key_cache, value_cache, meta, scale))
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)
