"""PackedLinear: a bf16 linear layer with a weight layout for each batch size.

Plain F.linear in bf16 re-lays-out the weight on every call; on this class of CPU that costs
more than the matmul at decode batch sizes. So the weight is laid out once at load time. With
the native kernels and a shape that tiles evenly (both sizes multiples of 32), that layout is
amx_pack_weight's tiles, on every CPU:
- more than SMALL_BATCH_ROWS rows: amx_linear's tile products on an AMX CPU; elsewhere
  vector_linear's AVX512-BF16 products over the same tiles (AMD EPYC Zen 4, 1.5B shapes, one
  thread: 0.94-1.27x oneDNN's blocked layout from 16 to 256 rows, 1.06-1.71x at 3-8; see
  docs/benchmarks.md);
- up to SMALL_BATCH_ROWS rows (single-stream decode, the LM head of a few requests):
  tile_small_linear's AVX512-BF16 dot products over the tiles (on AMX oneDNN streams a packed
  weight at only ~10 GB/s for one row and the tile product is no faster; on Zen 4 oneDNN's
  one- and two-row products run 0.47-0.79x as fast as tile_small_linear's).
Without the native kernels, or for a shape the tiles do not fit, oneDNN's blocked layout (as
PyTorch's inductor packs with weight freezing) serves every batch size, plus a row-major copy
for small_batch_linear on an AMX CPU (oneDNN's one-row products are slowest there). Each layer
thus holds one bf16 layout of its weight; two only on an AMX CPU for a shape that is not a
multiple of 32.
Only used for bfloat16; float32 keeps nn.Linear (the exactness tests run in float32 against
Hugging Face). A GGUF model's linears are GGUFLinear (gguf_linear.py), over the file's blocks.
"""

from __future__ import annotations

import torch
from torch import nn

# Rows up to which a single call takes the small-batch kernels. The kernels take up to 8
# (kSmallBatchRows in csrc/kernels.h); 5-8 rows use them only inside the decode stack
# (engine/models/decode_stack.py), for decode-only steps: a 5-8-token prefill or prompt-logprob
# pass stays on the large-batch path, so a prompt's logprobs come out the same alone or
# batched with another prompt.
SMALL_BATCH_ROWS = 4


def packing_available() -> bool:
    """Whether oneDNN can hold bf16 weights packed: it needs AVX512-BW/VL/DQ (or AVX-NE-CONVERT);
    on an AVX2-only CPU bf16 layers stay plain nn.Linear (torch converts per call)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_linear_pointwise")
        and mkldnn._is_mkldnn_bf16_supported()
    )


class PackedLinear(nn.Module):
    """Owns one linear layer's weight in the layout its batch sizes need: `tiles`
    (amx_pack_weight, with the native kernels and a shape that tiles evenly) read by
    tile_small_linear for 1-SMALL_BATCH_ROWS rows and by amx_linear (AMX) or vector_linear above;
    else `packed_weight` (oneDNN), with `weight` (row-major, small_batch_linear) beside it for
    small batches on AMX CPUs only."""

    def __init__(self, linear: nn.Linear, kernels=None) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features, in_features = weight.shape
        self.in_features = in_features
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.kernels = kernels
        self.amx = kernels is not None and kernels.amx_available()
        self.weight = None
        self.tiles = None
        self.packed_weight = None
        # Set by engine/batch_invariance.py: every row count on the tiles' large-batch product
        # (amx_linear or vector_linear), whose per-row sums do not depend on the other rows; the
        # small-batch kernels round otherwise.
        self.tiles_only = False
        if _tiles_fit(kernels, self.out_features, in_features):
            self.tiles = kernels.amx_pack_weight(weight)
        else:
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
            self.weight = weight.contiguous() if self.amx else None

    def bytes_read(self, num_rows: int) -> int:
        """Bytes of weight (and bias) one forward over num_rows rows streams, as the path
        forward() takes for that many rows reads them (the meter's bytes moved)."""
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        # Row-major, the tiles and oneDNN's blocked layout hold the same bf16 values.
        return self.out_features * self.in_features * 2 + bias

    def _small_batch_path(self, num_rows: int) -> bool:
        """Whether num_rows rows go to a small-batch kernel (over the tiles or row-major)."""
        small_layout = self.weight is not None or self.tiles is not None
        return small_layout and 0 < num_rows <= SMALL_BATCH_ROWS and not self.tiles_only

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self._small_batch_path(flat.shape[0]):
            if self.tiles is not None:
                out = self.kernels.tile_small_linear(flat.contiguous(), self.tiles, self.bias)
            else:
                out = self.kernels.small_batch_linear(flat.contiguous(), self.weight, self.bias)
        elif self.tiles is not None:
            large_batch = self.kernels.amx_linear if self.amx else self.kernels.vector_linear
            out = large_batch(flat, self.tiles, self.bias)
        else:
            out = torch.ops.mkldnn._linear_pointwise(
                flat, self.packed_weight, self.bias, "none", [], ""
            )
        return out.reshape(*x.shape[:-1], self.out_features)


def _tiles_fit(kernels, out_features: int, in_features: int) -> bool:
    return kernels is not None and out_features % 32 == 0 and in_features % 32 == 0


def pack_linears(model: nn.Module, kernels=None) -> int:
    """Swap every bf16 nn.Linear in `model` for a PackedLinear, one layer at a time, so only
    one layer's new layout is in flight beside the weights. Returns how many were swapped."""
    count = 0
    # Parents only: a list of every module would keep each replaced nn.Linear (and so its
    # weight) alive until the end.
    parents = [m for m in model.modules() if any(_packs(c) for c in m.children())]
    for parent in parents:
        names = [name for name, child in parent.named_children() if _packs(child)]
        for name in names:
            child = getattr(parent, name)
            setattr(parent, name, PackedLinear(child, kernels))
            count += 1
    return count


def _packs(module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and module.weight.dtype == torch.bfloat16
