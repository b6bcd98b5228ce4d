"""Int8Linear: a linear layer with int8 weights per output channel and int8 activations per token.

`--quantization int8` (EngineConfig.quantization) swaps every bf16 linear but the LM head for
one at load, layer by layer. Decode is bound by streaming weights, so int8 halves a token's
bytes; larger batches run AMX-INT8 tiles (twice AMX-BF16's peak).

Arithmetic (the kernel, csrc/int8_linear.cpp, and int8_linear_reference below, exactly):
- weight, once: scale_w[n] = max_k |w[n, k]| / 127, q_w = round(w * (127 / max)) in [-127, 127];
- activations, each call, per row: the same with x's row maximum (scale_x[m], q_x);
- out[m, n] = sum_k q_x[m, k] q_w[n, k] (exact int32) * (scale_x[m] * scale_w[n]) (+ bias),
  rounded to bf16.
The int32 sums are exact, so the kernel and the reference differ only in the fp32 epilogue's
rounding (the kernel fuses the multiply and the bias add): at most one bf16 ulp. A row's result
depends on that row alone, bit for bit, whatever the batch and path (AMX tiles or vpdpbusd).

One layout per weight: `packed` [N / 16, K / 64, 16, 16, 4], read by both kernel paths.
The LM head stays bf16 (PackedLinear): it is tied to the embedding in the models we serve, so
an int8 head would be a second copy beside the bf16 embedding the lookup needs.
"""

from __future__ import annotations

import torch
from torch import nn

# The kernels' tiling: 32 output columns per block, 64 k per tile.
COLUMN_MULTIPLE = 32
DEPTH_MULTIPLE = 64


def fits(out_features: int, in_features: int) -> bool:
    """Whether the int8 kernels take a weight of this shape (else the layer stays bf16)."""
    return out_features % COLUMN_MULTIPLE == 0 and in_features % DEPTH_MULTIPLE == 0


def quantize_symmetric(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of a 2-D tensor: (int8 codes, fp32 scales), codes = round(v * (127 / max|v|))
    clamped to [-127, 127] (ties to even), scale = max|v| / 127; a zero row has scale 0.
    The kernels quantize activations with exactly these fp32 operations."""
    v = values.float()
    amax = v.abs().amax(dim=1)
    inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))
    codes = torch.round(v * inv[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, amax / 127.0


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernels' layout packed[n / 16][k / 64][(k % 64) / 4][n % 16][k % 4]."""
    n, k = codes.shape
    return codes.reshape(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the int8 [N, K] weight."""
    n_tiles, k_tiles = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(n_tiles * 16, k_tiles * 64)


def int8_linear_reference(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (x bf16 [M, K] -> bf16 [M, N]). The integer
    product runs in float64, exact for these sums (|sum| < 2^31 < 2^53)."""
    x_codes, x_scales = quantize_symmetric(x)
    sums = x_codes.double() @ unpack(packed).double().T
    out = sums.float() * (x_scales[:, None] * scales[None, :])
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


class Int8Linear(nn.Module):
    """Owns one linear layer's int8 weight (the packed layout, fp32 scales per output channel,
    int32 row sums for the vpdpbusd path) and its bf16 bias; forward quantizes the activations
    per row and runs the kernels (AMX-INT8 tiles above 8 rows where use_amx, else vpdpbusd),
    or int8_linear_reference without kernels."""

    def __init__(self, linear: nn.Linear, kernels=None, use_amx: bool | None = None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(f"int8 kernels need N % 32 == 0 and K % 64 == 0, got {weight.shape}")
        codes, self.scales = quantize_symmetric(weight)
        self.row_sums = codes.sum(dim=1, dtype=torch.int32)
        self.packed = pack(codes)
        del codes
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.kernels = kernels
        if use_amx is None:
            use_amx = kernels is not None and kernels.amx_int8_available()
        self.use_amx = use_amx

    def bytes_read(self, num_rows: int) -> int:
        """Bytes one forward streams, whatever num_rows: codes, scales, row sums (and bias)."""
        tensors = (self.packed, self.scales, self.row_sums, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.kernels is None:
            out = int8_linear_reference(flat, self.packed, self.scales, self.bias)
        else:
            out = self.kernels.int8_linear(
                flat, self.packed, self.scales, self.row_sums, self.bias, self.use_amx
            )
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, kernels=None, skip: tuple[nn.Module, ...] = ()) -> int:
    """Swap every bf16 nn.Linear of a shape the kernels take, but those in `skip` (the LM
    head), for an Int8Linear, one layer at a time: each bf16 weight is dropped as soon as its
    int8 form exists, so only one layer's tensors are in flight. Returns how many."""
    count = 0
    # Parents only: a list of every module would keep each replaced weight alive to the end.
    parents = [m for m in model.modules() if any(_quantizes(c, skip) for c in m.children())]
    for parent in parents:
        names = [name for name, child in parent.named_children() if _quantizes(child, skip)]
        for name in names:
            setattr(parent, name, Int8Linear(getattr(parent, name), kernels))
            count += 1
    return count


def quantize_linear(model: nn.Module, name: str, kernels=None) -> bool:
    """Swap the linear `name` of model for an Int8Linear if quantize_linears would; whether it
    did (used while loading: a bias loaded after the weight is carried over by the caller's
    second pass, quantize_linears, so only bias-free layers are converted here)."""
    module = model.get_submodule(name)
    if not _quantizes(module, ()) or module.bias is not None:
        return False
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, Int8Linear(module, kernels))
    return True


def _quantizes(module: nn.Module, skip: tuple[nn.Module, ...]) -> bool:
    if not isinstance(module, nn.Linear) or any(module is s for s in skip):
        return False
    return module.weight.dtype == torch.bfloat16 and fits(*module.weight.shape)
