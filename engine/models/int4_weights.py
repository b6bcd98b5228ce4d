"""--quantization int4: a bf16 checkpoint's linear layers rewritten at load as Q4_1 blocks.

Weight-only, group-wise: every 32 weights of a row are one Q4_1 block (an fp16 scale d and
minimum m, 32 four-bit codes q; w ≈ d q + m), quantized by gguf-py (the quantizer llama.cpp's
Python tools use), 5 bits a weight where bf16 spends 16. The layers become GGUFLinears, so the
GGUF kernels serve them exactly as they serve a Q4_1 file: block matvecs and the decode stack
for small batches, block panels above (every pass reads the blocks: no float copy is kept).
Activations stay bf16. Like int8 the LM head stays bf16: tied to the embedding in the models
we serve, a quantized head would be a second copy beside the table the lookup needs.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType
from gguf.quants import quantize
from torch import nn

from engine.gguf_tensors import GGUFBlocks
from engine.models.gguf_linear import GGUFLinear

INT4_KIND = GGMLQuantizationType.Q4_1
BLOCK = 32  # weights per Q4_1 block


def int4_blocks(weight: torch.Tensor) -> GGUFBlocks:
    """weight [N, K] (K % 32 == 0) -> its Q4_1 blocks, gguf-py's rounding (from float32)."""
    blocks = quantize(weight.float().numpy(), INT4_KIND)
    return GGUFBlocks(
        int(INT4_KIND), torch.from_numpy(np.ascontiguousarray(blocks)), weight.shape[1]
    )


def int4_linear(linear: nn.Linear, dtype: torch.dtype) -> GGUFLinear:
    """A GGUFLinear over linear's weight in Q4_1 blocks, its bias kept as it is."""
    return GGUFLinear([int4_blocks(linear.weight.detach())], linear.in_features, linear.bias, dtype)


def quantize_linears_int4(model: nn.Module, dtype: torch.dtype, skip: tuple[nn.Module, ...]) -> int:
    """Swap every bf16 nn.Linear the blocks take, but those in `skip` (the LM head), for its
    int4 GGUFLinear, one layer at a time. Returns how many."""
    count = 0
    parents = [m for m in model.modules() if any(_quantizes(c, skip) for c in m.children())]
    for parent in parents:
        for name, child in list(parent.named_children()):
            if _quantizes(child, skip):
                setattr(parent, name, int4_linear(child, dtype))
                count += 1
    return count


def quantize_linear_int4(model: nn.Module, name: str, dtype: torch.dtype) -> bool:
    """Swap the linear `name` as it loads, when quantize_linears_int4 would and it has no bias
    (a bias loads after its weight: those layers convert in the second pass). Whether it did."""
    module = model.get_submodule(name)
    if not _quantizes(module, ()) or module.bias is not None:
        return False
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, int4_linear(module, dtype))
    return True


def _quantizes(module: nn.Module, skip: tuple[nn.Module, ...]) -> bool:
    if not isinstance(module, nn.Linear) or any(module is s for s in skip):
        return False
    return module.weight.dtype == torch.bfloat16 and module.in_features % BLOCK == 0
