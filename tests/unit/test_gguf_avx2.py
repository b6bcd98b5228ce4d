"""The AVX2 GGUF kernels (engine/kernels/csrc_avx2) against engine/gguf_blocks.py's plain-torch
dequantize (STYLE 11), per format: gguf_dequantize_f32 equal bit for bit, gguf_matvec_f32 at
every row count it serves and gguf_panel_f32 at any equal to x @ w.T up to fp32 summation order.

They run on every x86 CPU with AVX2 + FMA + F16C (AVX-512 machines too), so CI tests them
everywhere; the serving path uses them only for float32 GGUF models.
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_block_samples import COLS, KINDS, ROWS, make_blocks

from engine import gguf_blocks
from engine.kernels import load_avx2_kernels

avx2 = load_avx2_kernels()
pytestmark = pytest.mark.skipif(avx2 is None, reason="no AVX2 + FMA + F16C, or no compiler")
# fp32 sums in another order than torch's: relative error ~ K * 2^-24 of the terms' magnitude.
F32_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_the_reference_bit_for_bit(kind) -> None:
    blocks = make_blocks(kind, ROWS, COLS, seed=kind + 100)
    want = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_dequantize_f32(blocks, kind, ROWS, COLS)
    assert got.abs().max() > 0 and torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_matvec_matches_the_exact_weights(kind, rows) -> None:
    blocks = make_blocks(kind, ROWS, COLS, seed=rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS), torch.randn(ROWS)
    weights = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_matvec_f32(x, blocks, kind, ROWS, bias)
    torch.testing.assert_close(got, x @ weights.T + bias, **F32_TOLERANCE)
    torch.testing.assert_close(avx2.gguf_matvec_f32(x, blocks, kind, ROWS), x @ weights.T,
                               **F32_TOLERANCE)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 9, 11, 64])
def test_panels_match_the_exact_weights(kind, rows) -> None:
    """Any row count (remainders of the 3-row blocks) and N not a multiple of the 4-row panels."""
    n = ROWS - 3
    blocks = make_blocks(kind, n, COLS, seed=rows + 7)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS), torch.randn(n)
    weights = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_panel_f32(x, blocks, kind, n, bias)
    torch.testing.assert_close(got, x @ weights.T + bias, **F32_TOLERANCE)


def test_matvec_rejects_what_it_cannot_read() -> None:
    q4_k = int(GGMLQuantizationType.Q4_K)
    blocks = make_blocks(q4_k, 4, 256, seed=0)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="unsupported ggml block type"):
        avx2.gguf_matvec_f32(x, blocks, int(GGMLQuantizationType.Q2_K), 4)
    with pytest.raises(RuntimeError, match="not a whole number"):
        avx2.gguf_matvec_f32(x[:, :64], blocks, q4_k, 4)
    with pytest.raises(RuntimeError, match="5 x 144"):
        avx2.gguf_matvec_f32(x, blocks, q4_k, 5)
    with pytest.raises(RuntimeError, match=r"\[1..8, K\]"):
        avx2.gguf_matvec_f32(torch.randn(9, 256), blocks, q4_k, 4)
    with pytest.raises(RuntimeError, match="float32"):
        avx2.gguf_matvec_f32(x.bfloat16(), blocks, q4_k, 4)
