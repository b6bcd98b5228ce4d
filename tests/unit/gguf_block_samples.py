"""Sample GGUF blocks of every served format, for the kernel tests.

Blocks come from gguf-py's quantizer where it has one (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0); it can
only read the K-quants, so those are written from the ggml layout: random code and scale
bytes, finite fp16 d / dmin of a trained model's magnitude.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType, quants

from engine import gguf_blocks

SERVED = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]  # issue 22
KINDS = [int(GGMLQuantizationType[name]) for name in SERVED]
QUANTIZABLE = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}  # gguf-py's quantize_blocks
ROWS, COLS = 96, 512


def make_blocks(kind: int, rows: int, cols: int, seed: int) -> torch.Tensor:
    """uint8 [rows, row_bytes(kind, cols)] blocks of ggml type `kind`."""
    fmt = gguf_blocks.block_format(kind)
    rng = np.random.default_rng(seed)
    if fmt.name in QUANTIZABLE:
        weights = rng.standard_normal((rows, cols)).astype(np.float32) * 0.05
        return torch.from_numpy(quants.quantize(weights, GGMLQuantizationType(kind)))
    shape = (rows, cols // fmt.block_weights)
    blocks = rng.integers(0, 256, size=(*shape, fmt.block_bytes), dtype=np.uint8)

    def halves(low: float, high: float) -> np.ndarray:
        return rng.uniform(low, high, size=(*shape, 1)).astype(np.float16).view(np.uint8)

    if fmt.name == "Q6_K":
        blocks[..., 208:210] = halves(1e-4, 1e-3)  # d (after the int8 scales)
    else:
        blocks[..., 0:2] = halves(1e-4, 2e-3)  # d
        blocks[..., 2:4] = halves(1e-4, 2e-3)  # dmin
    return torch.from_numpy(blocks.reshape(rows, -1))
