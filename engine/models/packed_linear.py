"""PackedLinear: a bf16 linear layer whose weight is pre-packed in oneDNN's blocked layout.

Plain F.linear in bf16 re-lays-out the weight on every call; on this class of CPU (AMX) that
costs more than the matmul at decode batch sizes. Packing once at load time, as PyTorch's own
inductor does with weight freezing, makes decode steps several times faster. Only used for
bfloat16 on CPUs where oneDNN is available; float32 keeps nn.Linear (the exactness tests run
in float32 against Hugging Face).
"""

from __future__ import annotations

import torch
from torch import nn


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach()
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        out = torch.ops.mkldnn._linear_pointwise(
            flat, self.packed_weight, self.bias, "none", [], ""
        )
        return out.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 nn.Linear in `model` for a PackedLinear; returns how many."""
    count = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16:
                setattr(parent, name, PackedLinear(child))
                count += 1
    return count
