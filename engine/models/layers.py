"""Building blocks shared by the Llama-family models: RMSNorm, rotary embedding, gated MLP."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """Normalizes in float32 and casts back, as Hugging Face's Llama RMSNorm does.

    float32 inputs take one fused op; bf16 inputs are upcast for the statistics first so the
    rounding matches HF's (normalize in float32, cast, then scale by the weight).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if x.dtype == torch.float32:
        return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    # HF: normalize in float32, cast back, then scale by the weight in the model's dtype.
    normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normed.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for positions [0, max_positions), built the way transformers builds them.

    inv_freq and the attention scaling come from transformers' RoPE init functions, so every
    rope_type a config names (default, linear, dynamic, yarn, llama3) is honoured; longrope is
    refused by the loader (its factor depends on the sequence length).
    """

    def __init__(self, config, head_dim: int, max_positions: int, dtype: torch.dtype) -> None:
        super().__init__()
        inv_freq, scaling = _rope_parameters(config, head_dim)
        positions = torch.arange(max_positions, dtype=torch.float)
        freqs = positions[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * scaling).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * scaling).to(dtype), persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[num_tokens] -> cos, sin of shape [num_tokens, 1, head_dim] (broadcast over heads)."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, heads, head_dim], rotate-half convention (HF checkpoints' layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _rope_parameters(config, head_dim: int) -> tuple[torch.Tensor, float]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (base**exponents), 1.0
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, ops) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # .forward, not __call__: see engine/models/llama.py's docstring.
        return self.down_proj.forward(self.ops.silu_and_mul(self.gate_up_proj.forward(x)))
