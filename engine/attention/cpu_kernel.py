"""Paged attention on the native CPU kernels: decodes read K/V in place, no gather copy.

The step's new K/V go to their slots with one kernel call per layer; every decode row then
attends over its own block table (engine/kernels/csrc/paged_attention.cpp), so a short
request does not pay for the longest one's padding. Prefill chunks, all of the step's in one
call, go through the native causal flash attention over the paged cache
(engine/kernels/csrc/prefill_attention.cpp, AVX512-BF16), except where torch's own SDPA is
the better choice: on AMX CPUs (torch's CPU flash attention runs its products on AMX tiles
there; the native kernel was measured only on a CPU without AMX), in float32, and for head
sizes other than 64 and 128. Sliding windows and softcaps hold on every path (both kernels
take them; the torch prefill is batched.py's), and no path reads the cache blocks of keys
outside every query's window. Tested against ReferenceAttention.
"""

from __future__ import annotations

import torch

from engine.attention.batched import prefill_attention
from engine.attention.metadata import AttentionMetadata

NATIVE_PREFILL_HEAD_DIMS = (64, 128)  # the head sizes prefill_attention.cpp is built for


class CpuKernelAttention:
    name = "cpu_kernels"

    def __init__(self, kernels, native_prefill: bool | None = None) -> None:
        self.kernels = kernels
        self.native_prefill = (
            not kernels.amx_available() if native_prefill is None else native_prefill
        )

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
        """sliding_window and softcap as in ReferenceAttention.forward (the kernels take 0 for
        none); keys outside a window are not read at all."""
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
                    sliding_window or 0,
                    softcap or 0.0,
                )
            )
        if meta.prefill_spans is not None:
            outputs.extend(
                self._prefill(
                    query, key, value, key_cache, value_cache, meta, scale, sliding_window, softcap
                )
            )
        return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)

    def _prefill(
        self, query, key, value, key_cache, value_cache, meta, scale, sliding_window, softcap
    ) -> list:
        """The prefill chunks' outputs, in batch order (their K/V are already in the cache)."""
        if not self._prefill_natively(query):
            return prefill_attention(
                query, key, value, key_cache, value_cache, meta, scale, sliding_window, softcap
            )
        out = self.kernels.paged_prefill_attention(
            query,
            key_cache,
            value_cache,
            meta.prefill_block_tables,
            meta.prefill_spans,
            meta.block_size,
            scale,
            sliding_window or 0,
            softcap or 0.0,
        )
        return [out]

    def _prefill_natively(self, query: torch.Tensor) -> bool:
        return (
            self.native_prefill
            and query.dtype == torch.bfloat16
            and query.shape[-1] in NATIVE_PREFILL_HEAD_DIMS
        )
