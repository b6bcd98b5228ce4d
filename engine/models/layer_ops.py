"""LayerOps: the small per-layer operations of a decoder, plain torch or fused native kernels.

A model calls its ops object for RMSNorm (with the residual add fused in), rotary embedding
and the gated activation. TorchLayerOps is the reference, written with the same torch ops
Hugging Face's Llama code uses; KernelLayerOps runs the C++ kernels of engine/kernels, which
round bfloat16 where those torch ops round, and is tested against TorchLayerOps
(tests/unit/test_cpu_kernels.py); on a CPU without AVX-512 it runs a float32 model on the AVX2
module's kernels of the same names (csrc_avx2/layer_ops.cpp, tests/unit/test_layer_ops_avx2.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.models.layers import RotaryEmbedding, apply_rotary, rms_norm


@dataclass(slots=True)
class RotaryInputs:
    """What a step's tokens need for RoPE, prepared once per step and shared by all layers."""

    positions: torch.Tensor  # [num_tokens] int64
    cos: torch.Tensor  # torch ops: [num_tokens, 1, head_dim]; kernels: the full table
    sin: torch.Tensor


class TorchLayerOps:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def rms_norm_heads_(self, x, first_column: int, weight, num_heads: int, eps: float) -> None:
        """In place: num_heads heads of weight.numel() columns of each row of x [rows, width],
        from first_column, each RMS-normalized and scaled by weight (Qwen3's q and k norms)."""
        columns = slice(first_column, first_column + num_heads * weight.numel())
        heads = x[:, columns].unflatten(1, (num_heads, weight.numel()))
        x[:, columns] = rms_norm(heads, weight, eps).flatten(1)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        """(rms_norm(residual + x), residual + x)."""
        residual = residual + x
        return self.rms_norm(residual, weight, eps), residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return nn.functional.silu(gate) * up

    def rotary_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RotaryInputs:
        cos, sin = rotary(positions)
        return RotaryInputs(positions, cos, sin)

    def rotate_heads(
        self, qkv: torch.Tensor, rope: RotaryInputs, num_heads: int, head_dim: int
    ) -> torch.Tensor:
        """RoPE on the first num_heads heads of each qkv row -> [num_tokens, num_heads, dim]."""
        heads = qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)
        return apply_rotary(heads, rope.cos, rope.sin)


class KernelLayerOps:
    name = "cpu_kernels"

    def __init__(self, kernels) -> None:
        self.kernels = kernels

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self.kernels.rms_norm(x, weight, eps)

    def rms_norm_heads_(self, x, first_column: int, weight, num_heads: int, eps: float) -> None:
        self.kernels.rms_norm_heads_(x, first_column, weight, num_heads, eps)

    def add_rms_norm(self, x, residual, weight, eps) -> tuple[torch.Tensor, torch.Tensor]:
        # In place: x and residual are this step's own activations, never weights or inputs.
        self.kernels.add_rms_norm_(x, residual, weight, eps)
        return x, residual

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self.kernels.silu_and_mul(gate_up)

    def rotary_inputs(self, rotary: RotaryEmbedding, positions: torch.Tensor) -> RotaryInputs:
        return RotaryInputs(positions, rotary.cos, rotary.sin)

    def rotate_heads(
        self, qkv: torch.Tensor, rope: RotaryInputs, num_heads: int, head_dim: int
    ) -> torch.Tensor:
        self.kernels.rotary_(qkv, rope.positions, rope.cos, rope.sin, num_heads, head_dim)
        return qkv[:, : num_heads * head_dim].view(qkv.shape[0], num_heads, head_dim)


def make_layer_ops(kernels) -> TorchLayerOps | KernelLayerOps:
    return TorchLayerOps() if kernels is None else KernelLayerOps(kernels)
