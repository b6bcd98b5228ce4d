"""Int8Linear and the int8 kernels against their plain-torch reference (int8_linear_reference):
the activation quantization (with and without smoothing and rotation) bit for bit, the products
at 1, 5, 9 and 64 rows on both kernel paths within one bf16 ulp (only the fp32 epilogue's
rounding may differ), the two paths and every batch size the same bits per row; the Hadamard
rotation and the smoothing; the layout, the bytes the meter counts, the swap."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import load_cpu_kernels
from engine.models.int8_linear import (
    Int8Linear,
    hadamard_blocks,
    int8_linear_reference,
    pack,
    prepared_activations,
    quantize_linears,
    quantize_symmetric,
    rotated_weight,
    smoothing,
    unpack,
)

KERNELS = load_cpu_kernels()
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="native CPU kernels not available")
# vpdpbusd serves every machine; AMX-INT8 tiles only where the CPU and Linux grant them.
PATHS = [False] + ([True] if KERNELS is not None and KERNELS.amx_int8_available() else [])
BF16_ULP = 2.0**-7  # relative spacing of bf16 values at worst (8 significant bits)


def _linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    gen = torch.Generator().manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.copy_(0.05 * torch.randn(n, k, generator=gen))
        if bias:
            linear.bias.copy_(torch.randn(n, generator=gen))
    return linear


def _x(rows: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    x[0, 3] = 9.0  # an outlier, as real activations have
    return x.to(torch.bfloat16)


def test_pack_is_the_documented_layout_and_unpack_inverts_it() -> None:
    codes = torch.randint(-127, 128, (64, 128), dtype=torch.int8)
    packed = pack(codes)
    assert packed.shape == (4, 2, 16, 16, 4)
    n, k = 37, 101
    assert packed[n // 16, k // 64, (k % 64) // 4, n % 16, k % 4] == codes[n, k]
    assert torch.equal(unpack(packed), codes)


def test_quantize_symmetric_per_row() -> None:
    values = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    codes, scales = quantize_symmetric(values)
    assert codes.tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]  # 63.5 rounds to even 64
    assert scales.tolist() == pytest.approx([1.0 / 127, 0.0])


def _input_max(k: int, seed: int) -> torch.Tensor:
    """A calibration's input maxima: positive, uneven, one outlier channel (3, as _x has)."""
    gen = torch.Generator().manual_seed(seed)
    maxima = 0.5 + 3.0 * torch.rand(k, generator=gen)
    maxima[3] = 9.0
    return maxima


def test_hadamard_blocks_is_the_orthonormal_sylvester_matrix_per_block() -> None:
    h = torch.ones(1, 1)
    while h.shape[0] < 64:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    values = torch.randn(3, 128, generator=torch.Generator().manual_seed(0))
    want = torch.cat([values[:, :64] @ h, values[:, 64:] @ h], dim=1) / 8
    torch.testing.assert_close(hadamard_blocks(values), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(hadamard_blocks(hadamard_blocks(values)), values, atol=1e-6, rtol=0)
    torch.testing.assert_close(rotated_weight(values), want, rtol=0, atol=1e-5)  # at load
    # An outlier is spread over its block: the row maximum falls by the block's sqrt(64).
    spike = torch.zeros(1, 64)
    spike[0, 5] = 8.0
    assert hadamard_blocks(spike).abs().max() == 1.0


def test_smoothing_moves_activation_range_into_the_weight() -> None:
    weight = torch.tensor([[0.5, -1.0, 2.0], [0.25, 0.5, -4.0]])
    input_max = torch.tensor([16.0, 1.0, 0.0])  # the last channel never seen active
    s = smoothing(weight, input_max)
    want = input_max[:2] ** 0.7 / torch.tensor([0.5, 1.0]) ** 0.3
    torch.testing.assert_close(s[:2], want)
    assert s[2] == 1.0


@needs_kernels
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("rotate", [False, True])
def test_kernel_quantizes_activations_exactly_as_the_reference(smooth: bool, rotate: bool) -> None:
    x = _x(7, 256, seed=1)
    x[2] = 0.0  # a zero row: scale 0, codes 0
    inv_smooth = 1.0 / _input_max(256, seed=2) if smooth else None
    codes, scales = KERNELS.int8_quantize_rows(x, inv_smooth, rotate)
    want_codes, want_scales = quantize_symmetric(prepared_activations(x, inv_smooth, rotate))
    assert torch.equal(codes, want_codes)
    assert torch.equal(scales, want_scales)


@needs_kernels
@pytest.mark.parametrize("use_amx", PATHS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("smooth", [False, True])
@pytest.mark.parametrize("rows", [1, 5, 9, 64])
def test_kernel_matches_reference(use_amx: bool, bias: bool, smooth: bool, rows: int) -> None:
    input_max = _input_max(192, seed=rows) if smooth else None
    linear = _linear(96, 192, bias, seed=rows)
    layer = Int8Linear(linear, KERNELS, use_amx=use_amx, input_max=input_max)
    x = _x(rows, 192, seed=rows + 100)
    out = layer(x)
    want = int8_linear_reference(
        x, layer.packed, layer.scales, layer.bias, layer.inv_smooth, rotate=True
    )
    assert out.dtype == torch.bfloat16 and out.shape == (rows, 96)
    torch.testing.assert_close(out.float(), want.float(), rtol=BF16_ULP, atol=1e-30)


def test_smoothing_and_rotation_cut_the_error_of_outlier_channels() -> None:
    # Activations with a few channels 20x the rest (what real models' layers see): per-token
    # scales alone spend the int8 range on them; rotated and smoothed, the error falls.
    gen = torch.Generator().manual_seed(9)
    spread = torch.ones(256)
    spread[::37] = 20.0
    x = (torch.randn(64, 256, generator=gen) * spread).to(torch.bfloat16)
    linear = _linear(96, 256, False, seed=9)
    want = x.float() @ linear.weight.detach().float().T

    def error(layer: Int8Linear) -> float:
        return float((layer.reference(x).float() - want).abs().max() / want.abs().max())

    plain = Int8Linear(linear)
    plain.rotate = False  # the instance only: what the layer did before rotation
    plain_codes, plain.scales = quantize_symmetric(linear.weight.detach())
    plain.packed = pack(plain_codes)
    rotated = Int8Linear(linear)
    smoothed = Int8Linear(linear, input_max=x.float().abs().amax(dim=0))
    assert error(smoothed) < error(rotated) < 0.6 * error(plain)
    assert error(smoothed) < 0.01


def test_dequantized_weight_undoes_the_stored_form() -> None:
    linear = _linear(64, 128, False, seed=4)
    layer = Int8Linear(linear, input_max=_input_max(128, seed=4))
    weight = linear.weight.float()
    error = (layer.dequantized_weight() - weight).abs()
    assert error.max() < 0.05 * weight.abs().max()  # int8 rounding, not a transform left over


@needs_kernels
def test_reference_is_close_to_the_bf16_product() -> None:
    linear = _linear(128, 256, False, seed=3)
    x = _x(9, 256, seed=4)
    got = Int8Linear(linear, KERNELS)(x).float()
    want = x.float() @ linear.weight.float().T
    # int8 rounding of both operands: a small error relative to the outputs' spread.
    assert (got - want).abs().max() < 0.02 * want.abs().max()


@needs_kernels
def test_every_row_is_the_same_bits_alone_in_any_batch_on_either_path() -> None:
    layer = Int8Linear(_linear(64, 128, True, seed=5), KERNELS)
    x = _x(40, 128, seed=6)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(40)])
    for use_amx in PATHS:
        layer.use_amx = use_amx
        for rows in (3, 8, 9, 40):
            assert torch.equal(layer(x[:rows]), alone[:rows])


def test_bytes_read_are_the_int8_codes_scales_row_sums_and_smoothing() -> None:
    layer = Int8Linear(_linear(96, 192, True, seed=0))
    want = 96 * 192 + 96 * 4 + 96 * 4 + 96 * 2
    assert layer.bytes_read(1) == layer.bytes_read(64) == want
    smoothed = Int8Linear(_linear(96, 192, True, seed=0), input_max=_input_max(192, seed=0))
    assert smoothed.bytes_read(1) == want + 192 * 4


def test_quantize_linears_skips_the_head_and_shapes_the_kernels_do_not_take() -> None:
    head = _linear(64, 64, False, seed=1)
    odd = _linear(48, 64, False, seed=2)  # 48 columns: not a multiple of 32
    model = nn.Sequential(_linear(64, 64, False, seed=0), odd, head, nn.Linear(64, 64))
    assert quantize_linears(model, None, skip=(head,)) == 1
    assert isinstance(model[0], Int8Linear)
    assert model[1] is odd and model[2] is head
    assert isinstance(model[3], nn.Linear)  # float32 stays as it is


def test_int8_layer_without_kernels_is_the_reference() -> None:
    layer = Int8Linear(_linear(32, 64, True, seed=7))
    x = _x(3, 64, seed=8)
    assert torch.equal(layer(x), layer.reference(x))
    assert torch.equal(
        layer(x), int8_linear_reference(x, layer.packed, layer.scales, layer.bias, rotate=True)
    )
