"""GGUF block formats: engine/gguf_blocks.py's dequantize against gguf-py's, and the native
gguf_linear against dequantize (STYLE 11), per format, at 1, 5, 9, 16, 24, 32 and 64 rows.

Blocks: gguf_block_samples.py.

Tolerances: gguf_linear accumulates in fp32 in its own order and rounds once to bf16, so it
may differ from the fp32 reference rounded to bf16 by that rounding (one bf16 ulp, 2^-8
relative) plus fp32 summation error; the references are exact (no rounding before the sum).
"""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType, quants
from gguf_block_samples import COLS, KINDS, ROWS, make_blocks

from engine import gguf_blocks
from engine.kernels import load_cpu_kernels

BF16_TOLERANCE = {"atol": 1e-2, "rtol": 8e-3}


def test_the_table_is_ggml_s() -> None:
    assert sorted(gguf_blocks.FORMATS) == sorted(KINDS)
    q4_k = gguf_blocks.block_format(int(GGMLQuantizationType.Q4_K))
    assert (q4_k.block_weights, q4_k.block_bytes) == (256, 144)
    assert gguf_blocks.row_bytes(int(GGMLQuantizationType.Q8_0), 64) == 68
    assert gguf_blocks.is_supported(int(GGMLQuantizationType.Q6_K))
    assert not gguf_blocks.is_supported(int(GGMLQuantizationType.Q2_K))
    with pytest.raises(ValueError, match="Q2_K is not supported"):
        gguf_blocks.row_bytes(int(GGMLQuantizationType.Q2_K), 256)
    with pytest.raises(ValueError, match="multiples of 256"):
        gguf_blocks.row_bytes(int(GGMLQuantizationType.Q4_K), 576)


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_gguf_py(kind) -> None:
    blocks = make_blocks(kind, 24, COLS, seed=kind)
    want = quants.dequantize(blocks.numpy(), GGMLQuantizationType(kind))
    got = gguf_blocks.dequantize(kind, blocks, COLS)
    assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(want))
    assert got.abs().max() > 0


def test_dequantize_works_in_pieces_of_rows() -> None:
    kind = int(GGMLQuantizationType.Q4_0)
    blocks = make_blocks(kind, gguf_blocks._ROWS_PER_PIECE + 3, 64, seed=1)
    want = quants.dequantize(blocks.numpy(), GGMLQuantizationType(kind))
    assert torch.equal(gguf_blocks.dequantize(kind, blocks, 64), torch.from_numpy(want))


# --- gguf_linear -----------------------------------------------------------------------------

kernels = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(
    kernels is None, reason="native CPU kernels not available (no AVX512-BF16 or no compiler)"
)


def reference(x: torch.Tensor, kind: int, blocks: torch.Tensor, bias=None) -> torch.Tensor:
    """What gguf_linear computes for x's row count: the exact weights up to 4 rows
    (kGgufExactRows), the weights rounded to bf16 above, fp32 sums, one rounding."""
    weights = gguf_blocks.dequantize(kind, blocks, x.shape[1])
    if x.shape[0] > 4:
        weights = weights.bfloat16().float()
    out = x.float() @ weights.T
    return (out if bias is None else out + bias.float()).bfloat16()


def large_batch_paths() -> list[bool]:
    """use_amx values that pick different kernels here: AMX (where present) and AVX512-BF16."""
    return [True, False] if kernels.amx_available() else [False]


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 5, 9, 16, 24, 32, 64])
def test_gguf_linear_matches_its_reference(kind, rows) -> None:
    blocks = make_blocks(kind, ROWS, COLS, seed=rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, COLS, dtype=torch.bfloat16)
    want = reference(x, kind, blocks)
    for use_amx in large_batch_paths() if rows > 4 else [True]:
        got = kernels.gguf_linear(x, blocks, kind, ROWS, use_amx=use_amx)
        torch.testing.assert_close(got, want, **BF16_TOLERANCE)


@needs_kernels
@pytest.mark.parametrize("name", ["Q6_K", "Q4_K"])
@pytest.mark.parametrize("rows", [2, 3, 4, 6, 7, 8, 33])
def test_gguf_linear_every_small_row_count_and_a_ragged_shape(name, rows) -> None:
    """N not a multiple of the panels (32 rows on AMX, 16 without) and M not of 32; bias.
    Q4_K: the AMX tiles stage its sub-blocks two at a time (gguf::bf16_weight_pair)."""
    kind = int(GGMLQuantizationType[name])
    blocks = make_blocks(kind, 45, 256, seed=rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, 256, dtype=torch.bfloat16), torch.randn(45, dtype=torch.bfloat16)
    want = reference(x, kind, blocks, bias)
    for use_amx in large_batch_paths():
        got = kernels.gguf_linear(x, blocks.flatten(), kind, 45, bias, use_amx=use_amx)
        torch.testing.assert_close(got, want, **BF16_TOLERANCE)


@needs_kernels
@pytest.mark.parametrize("name", ["Q4_K", "Q5_K"])
@pytest.mark.parametrize("rows", [1, 9, 64])
def test_k_quant_rows_of_six_super_blocks(name, rows) -> None:
    """Q4_K and Q5_K unpack their scales four super-blocks at a time (gguf_blocks.h's
    k_params4), the rest one at a time: rows of 6 take both (COLS above gives 2)."""
    kind = int(GGMLQuantizationType[name])
    blocks = make_blocks(kind, 40, 1536, seed=rows)
    torch.manual_seed(rows)
    x = torch.randn(rows, 1536, dtype=torch.bfloat16)
    want = reference(x, kind, blocks)
    for use_amx in large_batch_paths():
        got = kernels.gguf_linear(x, blocks, kind, 40, use_amx=use_amx)
        torch.testing.assert_close(got, want, **BF16_TOLERANCE)


def int8_reference(x: torch.Tensor, kind: int, blocks: torch.Tensor, bias=None) -> torch.Tensor:
    """gguf_linear with int8_activations up to 8 rows: the exact weights times the inputs
    rounded to int8 per block (gguf_blocks.int8_inputs), fp32 sums, one rounding."""
    weights = gguf_blocks.dequantize(kind, blocks, x.shape[1])
    out = gguf_blocks.int8_inputs(kind, x) @ weights.T
    return (out if bias is None else out + bias.float()).bfloat16()


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_int8_activations_match_their_reference(kind, rows) -> None:
    """Every format's int8 kernel (gguf_int8.cpp), with a bias; past one row, the last row
    zeros (its scale 0)."""
    blocks = make_blocks(kind, 40, COLS, seed=rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS, dtype=torch.bfloat16), torch.randn(40, dtype=torch.bfloat16)
    if rows > 1:
        x[-1] = 0
    got = kernels.gguf_linear(x, blocks, kind, 40, bias, int8_activations=True)
    torch.testing.assert_close(got, int8_reference(x, kind, blocks, bias), **BF16_TOLERANCE)
    if rows > 1:
        assert torch.equal(got[-1], bias)
    assert not torch.equal(got[0], reference(x, kind, blocks, bias)[0])  # the inputs rounded


@needs_kernels
@pytest.mark.parametrize(
    ("name", "cols"), [("Q4_0", 96), ("Q5_1", 96), ("Q8_0", 96), ("Q4_K", 1536), ("Q6_K", 1536)]
)
def test_int8_activations_odd_blocks_and_six_super_blocks(name, cols) -> None:
    """An odd number of 32-weight blocks (the last one pairs with a zero block, read from a
    copy, never past the row), and K-quant rows of six super-blocks."""
    kind = int(GGMLQuantizationType[name])
    blocks = make_blocks(kind, 33, cols, seed=cols)
    x = torch.randn(2, cols, dtype=torch.bfloat16)
    got = kernels.gguf_linear(x, blocks, kind, 33, int8_activations=True)
    torch.testing.assert_close(got, int8_reference(x, kind, blocks), **BF16_TOLERANCE)


@needs_kernels
def test_int8_activations_leave_larger_batches_alone() -> None:
    """Above 8 rows (and with small_rows=0, batch-invariant mode's setting) the flag changes
    nothing: those passes multiply the weights as before."""
    kind = int(GGMLQuantizationType.Q4_K)
    blocks = make_blocks(kind, 32, COLS, seed=3)
    x = torch.randn(9, COLS, dtype=torch.bfloat16)
    plain = kernels.gguf_linear(x, blocks, kind, 32)
    assert torch.equal(kernels.gguf_linear(x, blocks, kind, 32, int8_activations=True), plain)
    one = x[:1].contiguous()
    assert torch.equal(
        kernels.gguf_linear(one, blocks, kind, 32, small_rows=0, int8_activations=True),
        kernels.gguf_linear(one, blocks, kind, 32, small_rows=0),
    )


@needs_kernels
def test_gguf_linear_rejects_what_it_cannot_read() -> None:
    x = torch.randn(1, 256, dtype=torch.bfloat16)
    q4_k = int(GGMLQuantizationType.Q4_K)
    blocks = make_blocks(q4_k, 4, 256, seed=0)
    with pytest.raises(RuntimeError, match="not supported"):
        kernels.gguf_linear(x, blocks, int(GGMLQuantizationType.Q2_K), 4)
    with pytest.raises(RuntimeError, match="not a whole number"):
        kernels.gguf_linear(x[:, :64], blocks, q4_k, 4)
    with pytest.raises(RuntimeError, match="out_features x 144"):
        kernels.gguf_linear(x, blocks, q4_k, 5)
