"""The AVX2 module's layer operations (engine/kernels/csrc_avx2/layer_ops.cpp) against the
plain-torch TorchLayerOps they replace on a CPU without AVX-512 (STYLE 11), in float32, through
KernelLayerOps as the model calls them: fp32 sums in another order and a polynomial exp, so a
tolerance of a few fp32 ulps. Every x86 CPU with AVX2 runs them, so CI tests them everywhere.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from engine.kernels import load_avx2_kernels
from engine.models.layer_ops import KernelLayerOps, TorchLayerOps
from engine.models.layers import RotaryEmbedding

avx2 = load_avx2_kernels()
pytestmark = pytest.mark.skipif(avx2 is None, reason="no AVX2 + FMA + F16C, or no compiler")
F32 = {"atol": 1e-5, "rtol": 1e-5}
reference = TorchLayerOps()
fused = KernelLayerOps(avx2) if avx2 is not None else None


# 1-3 rows run on one thread, 20 split across threads; 580 ends in a 4-element tail.
@pytest.mark.parametrize("rows", [1, 3, 20])
@pytest.mark.parametrize("hidden", [576, 580])
def test_rms_norm_and_add_rms_norm_match_torch(rows, hidden) -> None:
    torch.manual_seed(rows + hidden)
    x, residual = torch.randn(rows, hidden) * 3, torch.randn(rows, hidden)
    weight = torch.randn(hidden)
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **F32
    )
    want_x, want_residual = reference.add_rms_norm(x, residual, weight, 1e-6)
    got_x, got_residual = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)  # one add each
    torch.testing.assert_close(got_x, want_x, **F32)


@pytest.mark.parametrize("rows", [1, 20])
def test_rms_norm_heads_in_place_match_torch(rows) -> None:
    torch.manual_seed(rows)
    x = torch.randn(rows, 224) * 3
    weight = torch.randn(32)
    want, got = x.clone(), x.clone()
    reference.rms_norm_heads_(want, 64, weight, 3, 1e-6)
    fused.rms_norm_heads_(got, 64, weight, 3, 1e-6)
    torch.testing.assert_close(got, want, **F32)
    assert torch.equal(got[:, :64], x[:, :64]) and torch.equal(got[:, 160:], x[:, 160:])
    with pytest.raises(RuntimeError, match="past the end"):
        fused.rms_norm_heads_(got, 200, weight, 1, 1e-6)


@pytest.mark.parametrize("rows", [1, 19])
def test_silu_and_mul_matches_torch(rows) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(rows, 2 * 76) * 4  # 76: a 4-element tail
    gate_up[0, :4] = torch.tensor([-100.0, -90.0, 90.0, 0.0])  # exp's clamps, both sides
    torch.testing.assert_close(fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **F32)


def test_rotary_in_place_matches_torch() -> None:
    torch.manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 64
    rotary = RotaryEmbedding(LlamaConfig(head_dim=head_dim), head_dim, 256, torch.float32)
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim)
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 3])
    want = reference.rotate_heads(
        qkv, reference.rotary_inputs(rotary, positions), heads + kv_heads, head_dim
    )
    got_qkv = qkv.clone()
    got = fused.rotate_heads(
        got_qkv, fused.rotary_inputs(rotary, positions), heads + kv_heads, head_dim
    )
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(got_qkv[:, v_start:], qkv[:, v_start:])  # v untouched
    with pytest.raises(RuntimeError, match="past the tables"):
        avx2.rotary_(qkv, torch.tensor([0, 1, 5, 17, 100, 256, 3]), rotary.cos, rotary.sin, 1, 64)


def test_float32_only() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="float32 only"):
        avx2.rms_norm(x, torch.ones(64, dtype=torch.bfloat16), 1e-6)
