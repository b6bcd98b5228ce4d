"""PackedLinear, every path against a float32 matmul: small batches (1-4 rows) and larger ones,
with and without the native kernels; the layouts it keeps and the bytes it says it reads."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine.kernels import load_cpu_kernels
from engine.models.packed_linear import (
    SMALL_BATCH_ROWS,
    PackedLinear,
    pack_linears,
    packing_available,
)

pytestmark = pytest.mark.skipif(not packing_available(), reason="oneDNN packing unavailable")
KERNELS = {"torch": None, "kernels": load_cpu_kernels()}


def _linear(n: int, k: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    linear = nn.Linear(k, n, bias=bias).to(torch.bfloat16)
    linear.weight.data.normal_(0, 0.05)
    return linear


@pytest.mark.parametrize("which", sorted(KERNELS))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 3, SMALL_BATCH_ROWS, SMALL_BATCH_ROWS + 1, 33])
def test_every_path_matches_fp32_matmul(which: str, bias: bool, rows: int) -> None:
    kernels = KERNELS[which]
    if which == "kernels" and kernels is None:
        pytest.skip("native CPU kernels not available")
    linear = _linear(96, 160, bias, seed=rows)
    x = torch.randn(rows, 160, dtype=torch.bfloat16)
    want = linear.weight.float() @ x.float().T
    want = (want.T + (linear.bias.float() if bias else 0)).bfloat16()
    packed = PackedLinear(linear, kernels)
    torch.testing.assert_close(packed(x), want, atol=1e-2, rtol=1e-2)
    # The meter's figure: every path streams each bf16 weight once.
    assert packed.bytes_read(rows) == 96 * 160 * 2 + (96 * 2 if bias else 0)


@pytest.mark.parametrize("which", sorted(KERNELS))
def test_one_bf16_layout_at_every_batch_size(which: str) -> None:
    kernels = KERNELS[which]
    if which == "kernels" and kernels is None:
        pytest.skip("native CPU kernels not available")
    amx = kernels is not None and kernels.amx_available()
    packed = PackedLinear(_linear(64, 64, False, seed=0), kernels)
    # With the kernels the tiles serve every batch size, AMX or not; without, oneDNN's layout.
    layouts = [packed.weight, packed.tiles, packed.packed_weight]
    assert sum(layout is not None for layout in layouts) == 1
    assert (packed.tiles is not None) == (kernels is not None)
    # A shape the tiles do not fit keeps oneDNN's layout, and on AMX a row-major copy for the
    # small batches (oneDNN streams one row at ~10 GB/s there).
    linear = _linear(48, 40, False, seed=0)
    odd = PackedLinear(linear, kernels)
    assert odd.tiles is None and odd.packed_weight is not None
    assert (odd.weight is not None) == amx
    x = torch.randn(2, 40, dtype=torch.bfloat16)
    want = (x.float() @ linear.weight.float().T).bfloat16()
    torch.testing.assert_close(odd(x), want, atol=1e-2, rtol=1e-2)


def test_pack_linears_swaps_bf16_linears_only() -> None:
    model = nn.Sequential(_linear(32, 32, False, seed=1), nn.Linear(32, 32), nn.ReLU())
    assert pack_linears(model, KERNELS["kernels"]) == 1
    assert isinstance(model[0], PackedLinear) and isinstance(model[1], nn.Linear)
