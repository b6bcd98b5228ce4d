"""Paged attention on the AVX2 kernels, the float32 path of CPUs without AVX-512: decodes read
K/V in place.

Such a CPU has no native kernels module, only engine/kernels/csrc_avx2. The step's new K/V go
to their slots by index_copy_ (reference.write_kv); every decode row then attends over its own
block table (avx2.paged_decode_attention_f32), where the batched plain-torch backend gathers
every decode's blocks into one padded tensor per layer first: that copy cost as much as the
attention itself, and a short request paid for the longest one's padding. Prefill chunks take
batched.py's SDPA path (the class is BatchedAttention with its decode rows replaced). Sliding windows and softcaps hold on both. A bfloat16 model's decodes
(torch's emulated bf16 on such a CPU) take batched.py's path. Tested against
ReferenceAttention (tests/unit/test_paged_attention_avx2.py).
"""

from __future__ import annotations

import torch

from engine.attention.batched import BatchedAttention


class Avx2Attention(BatchedAttention):
    """BatchedAttention with the decode rows on the AVX2 kernel (float32)."""

    name = "avx2"

    def __init__(self, avx2) -> None:
        self.avx2 = avx2

    def _decode(self, query, key_cache, value_cache, meta, scale, sliding_window, softcap):
        if query.dtype != torch.float32:
            return super()._decode(
                query, key_cache, value_cache, meta, scale, sliding_window, softcap
            )
        return self.avx2.paged_decode_attention_f32(
            query.contiguous(),
            key_cache,
            value_cache,
            meta.decode_block_tables,
            meta.decode_context_lens,
            meta.block_size,
            scale,
            sliding_window or 0,
            softcap or 0.0,
        )
