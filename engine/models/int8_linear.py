"""Int8Linear: a linear layer with int8 weights per output channel and int8 activations per token.

`--quantization int8` (EngineConfig.quantization) swaps every bf16 linear but the LM head and
mixture-of-experts routers (ModelRunner._kept_in_bf16) for one at load, layer by layer.
Decode is bound by streaming weights, so int8 halves a token's bytes; larger batches run
AMX-INT8 tiles (twice AMX-BF16's peak), or vpdpbusd without AMX.

Two exact transforms before rounding keep outliers from setting the scales (on the embedded
SmolLM2-135M plain per-token int8 costs +8.7 % perplexity; with both, +0.6 %, docs/benchmarks.md):
- SmoothQuant smoothing (optional, from the calibration's input maxima, engine/int8_calibration.py):
  s[k] = max|x[:, k]|^ALPHA / max_n |w[n, k]|^(1 - ALPHA); the weight's columns are multiplied
  by s at load and the activations' channels by inv_smooth = 1 / s at each call, moving the
  activations' outlier channels into the weights, which are quantized per row;
- a rotation: every 64-wide block of k is multiplied by the orthonormal Hadamard matrix H
  (hadamard_blocks), on the weight's rows at load and on the activations at each call. H H = I,
  so x W^T = (x H)(W H)^T; an outlier channel is spread over its block of 64.

Arithmetic (the kernel, csrc/int8_linear.cpp, and int8_linear_reference below, exactly):
- weight, once: w' = rotated_weight(w * s) (the same rotation as one matmul), scale_w[n] = max_k |w'[n, k]| / 127,
  q_w = round(w' * (127 / max)) in [-127, 127];
- activations, each call, per row: v = hadamard_blocks(x * inv_smooth), quantized the same way
  with v's row maximum (scale_x[m], q_x);
- out[m, n] = sum_k q_x[m, k] q_w[n, k] (exact int32) * (scale_x[m] * scale_w[n]) (+ bias),
  rounded to bf16.
The int32 sums are exact and the activation transform is the same fp32 operations in the kernel
and the reference, so the two differ only in the fp32 epilogue's rounding (the kernel fuses the
multiply and the bias add): at most one bf16 ulp. A row's result depends on that row alone, bit
for bit, whatever the batch and path (AMX tiles or vpdpbusd).

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
# SmoothQuant's migration strength: 0.5-0.8 measured on the embedded model, 0.7 best.
SMOOTHING_ALPHA = 0.7
ROTATION_BLOCK = 64  # the Hadamard blocks of k (a divisor of DEPTH_MULTIPLE)


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


def hadamard_blocks(values: torch.Tensor) -> torch.Tensor:
    """fp32 [..., K] (K % 64 == 0) -> each 64-wide block of the last dim times the orthonormal
    Hadamard matrix (Sylvester's, symmetric, its own inverse): six butterfly stages (a + b,
    a - b at strides 1, 2, 4, ..., 32), then * 1/8; the kernel runs the same fp32 operations."""
    shape = values.shape
    v = values.reshape(-1, ROTATION_BLOCK)
    h = 1
    while h < ROTATION_BLOCK:
        pairs = v.reshape(v.shape[0], ROTATION_BLOCK // (2 * h), 2, h)
        a, b = pairs[:, :, 0], pairs[:, :, 1]
        v = torch.stack((a + b, a - b), dim=2).reshape(-1, ROTATION_BLOCK)
        h *= 2
    return (v * 0.125).reshape(shape)


def hadamard_matrix() -> torch.Tensor:
    """The orthonormal 64 x 64 Hadamard matrix (Sylvester's), fp32, entries +-1/8."""
    h = torch.ones(1, 1)
    while h.shape[0] < ROTATION_BLOCK:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h * 0.125


def rotated_weight(weight: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K]: each row's 64-wide blocks times the Hadamard matrix, as one matmul (at load
    ~10x faster than hadamard_blocks' butterflies; the weight's rounding needs no bit-match
    with the kernel, only the activations' does)."""
    n, k = weight.shape
    return (weight.reshape(-1, ROTATION_BLOCK) @ hadamard_matrix()).reshape(n, k)


def smoothing(weight: torch.Tensor, input_max: torch.Tensor) -> torch.Tensor:
    """SmoothQuant's per-input-channel factors s (fp32 [K]) for a weight [N, K] whose inputs
    reached input_max [K] on the calibration text; channels never seen active keep 1."""
    w_max = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    x_max = input_max.float()
    s = x_max.clamp(min=1e-5) ** SMOOTHING_ALPHA / w_max ** (1 - SMOOTHING_ALPHA)
    return torch.where(x_max > 0, s.clamp(min=1e-5), torch.ones_like(s))


def prepared_activations(
    x: torch.Tensor, inv_smooth: torch.Tensor | None, rotate: bool
) -> torch.Tensor:
    """The activations as they are quantized: x * inv_smooth (fp32), then rotated."""
    v = x.float()
    if inv_smooth is not None:
        v = v * inv_smooth
    return hadamard_blocks(v) if rotate else v


def pack(codes: torch.Tensor) -> torch.Tensor:
    """int8 [N, K] -> the kernels' layout packed[n / 16][k / 64][(k % 64) / 4][n % 16][k % 4]."""
    n, k = codes.shape
    return codes.reshape(n // 16, 16, k // 64, 16, 4).permute(0, 2, 3, 1, 4).contiguous()


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: the int8 [N, K] weight."""
    n_tiles, k_tiles = packed.shape[:2]
    return packed.permute(0, 3, 1, 2, 4).reshape(n_tiles * 16, k_tiles * 64)


def int8_linear_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    bias: torch.Tensor | None,
    inv_smooth: torch.Tensor | None = None,
    rotate: bool = False,
) -> torch.Tensor:
    """The kernel's arithmetic in plain torch (x bf16 [M, K] -> bf16 [M, N]). The integer
    product runs in float64, exact for these sums (|sum| < 2^31 < 2^53)."""
    x_codes, x_scales = quantize_symmetric(prepared_activations(x, inv_smooth, rotate))
    sums = x_codes.double() @ unpack(packed).double().T
    out = sums.float() * (x_scales[:, None] * scales[None, :])
    if bias is not None:
        out = out + bias.float()
    return out.to(torch.bfloat16)


class Int8Linear(nn.Module):
    """Owns one linear layer's int8 weight (the packed layout of its smoothed, rotated form, fp32
    scales per output channel, int32 row sums for the vpdpbusd path), the activations' smoothing
    (inv_smooth, fp32 [K], or None without calibration) and its bf16 bias; forward quantizes the
    activations per row and runs the kernels (AMX-INT8 tiles above 8 rows where use_amx, else
    vpdpbusd), or int8_linear_reference without kernels."""

    rotate = True  # always: it costs six adds per activation and never loses accuracy

    def __init__(
        self,
        linear: nn.Linear,
        kernels=None,
        use_amx: bool | None = None,
        input_max: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, self.in_features = weight.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(f"int8 kernels need N % 32 == 0 and K % 64 == 0, got {weight.shape}")
        transformed = weight.float()
        self.inv_smooth = None
        if input_max is not None:
            s = smoothing(weight, input_max)
            transformed = transformed * s
            self.inv_smooth = (1.0 / s).contiguous()
        codes, self.scales = quantize_symmetric(rotated_weight(transformed))
        del transformed
        self.row_sums = codes.sum(dim=1, dtype=torch.int32)
        self.packed = pack(codes)
        del codes
        self.bias = None if linear.bias is None else linear.bias.detach().to(torch.bfloat16)
        self.kernels = kernels
        if use_amx is None:
            use_amx = kernels is not None and kernels.amx_int8_available()
        self.use_amx = use_amx

    def bytes_read(self, num_rows: int) -> int:
        """Bytes one forward streams, whatever num_rows: codes, scales, row sums, the
        smoothing (and bias)."""
        tensors = (self.packed, self.scales, self.row_sums, self.inv_smooth, self.bias)
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    def dequantized_weight(self) -> torch.Tensor:
        """fp32 [N, K]: the weight this layer multiplies by, undone from its stored form
        (codes * scales, rotated back, columns divided by s)."""
        weight = hadamard_blocks(unpack(self.packed).float() * self.scales[:, None])
        return weight if self.inv_smooth is None else weight * self.inv_smooth

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """int8_linear_reference with this layer's tensors (x bf16 [M, K])."""
        return int8_linear_reference(
            x, self.packed, self.scales, self.bias, self.inv_smooth, self.rotate
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self.kernels is None:
            out = self.reference(flat)
        else:
            out = self.kernels.int8_linear(
                flat,
                self.packed,
                self.scales,
                self.row_sums,
                self.bias,
                self.use_amx,
                self.inv_smooth,
                self.rotate,
            )
        return out.reshape(*x.shape[:-1], self.out_features)


def quantize_linears(
    model: nn.Module,
    kernels=None,
    skip: tuple[nn.Module, ...] = (),
    input_maxima: dict[str, torch.Tensor] | None = None,
) -> int:
    """Swap every bf16 nn.Linear of a shape the kernels take, but those in `skip` (the LM
    head), for an Int8Linear (smoothed by input_maxima[its name] where the calibration has it),
    one layer at a time: each bf16 weight is dropped as soon as its int8 form exists, so only
    one layer's tensors are in flight. Returns how many."""
    count = 0
    # Parents only: a list of every module would keep each replaced weight alive to the end.
    parents = [
        (prefix, m)
        for prefix, m in model.named_modules()
        if any(_quantizes(c, skip) for c in m.children())
    ]
    for prefix, parent in parents:
        names = [name for name, child in parent.named_children() if _quantizes(child, skip)]
        for name in names:
            full = f"{prefix}.{name}" if prefix else name
            maxima = None if input_maxima is None else input_maxima.get(full)
            setattr(parent, name, Int8Linear(getattr(parent, name), kernels, input_max=maxima))
            count += 1
    return count


def quantize_linear(
    model: nn.Module,
    name: str,
    kernels=None,
    input_maxima: dict[str, torch.Tensor] | None = None,
) -> bool:
    """Swap the linear `name` of model for an Int8Linear if quantize_linears would; whether it
    did (used while loading: a bias loaded after the weight is carried over by the caller's
    second pass, quantize_linears, so only bias-free layers are converted here)."""
    module = model.get_submodule(name)
    if not _quantizes(module, ()) or module.bias is not None:
        return False
    parent, _, leaf = name.rpartition(".")
    maxima = None if input_maxima is None else input_maxima.get(name)
    setattr(model.get_submodule(parent), leaf, Int8Linear(module, kernels, input_max=maxima))
    return True


def _quantizes(module: nn.Module, skip: tuple[nn.Module, ...]) -> bool:
    if not isinstance(module, nn.Linear) or any(module is s for s in skip):
        return False
    return module.weight.dtype == torch.bfloat16 and fits(*module.weight.shape)
