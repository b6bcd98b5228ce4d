"""GGUFBlocks: rows of a weight as a GGUF file stores them, and the formats we read.

A block format (ggml's Q4_0 ... Q6_K) packs each row's weights into fixed-size blocks along the
input dimension, so rows are independent byte ranges: a weight's rows can be permuted,
gathered or stacked as plain uint8 rows [rows, row_bytes] without touching the values. F32,
F16 and BF16 tensors are read the same way (row_bytes = cols x element size) and viewed as
floats.

Dequantizing is engine/gguf_blocks.py's (equal to gguf-py's gguf.quants.dequantize, which
transformers uses).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.gguf_blocks import FORMATS, dequantize

FLOAT_DTYPES = {
    GGMLQuantizationType.F32.value: torch.float32,
    GGMLQuantizationType.F16.value: torch.float16,
    GGMLQuantizationType.BF16.value: torch.bfloat16,
}


def block_kinds() -> frozenset[int]:
    """ggml type ids of the block formats served natively (engine/gguf_blocks.py's table)."""
    return frozenset(FORMATS)


def kind_name(kind: int) -> str:
    try:
        return GGMLQuantizationType(kind).name
    except ValueError:
        return f"type {kind}"


def row_bytes(kind: int, cols: int) -> int:
    """Bytes of one stored row of `cols` weights in format `kind`."""
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
    if cols % block_size:
        raise ValueError(f"{kind_name(kind)} row of {cols} is not whole {block_size}-blocks")
    return cols // block_size * type_size


def dequantize_rows(kind: int, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """uint8 [rows, row_bytes] in format `kind` -> float32 [rows, cols]."""
    if kind in FLOAT_DTYPES:
        return blocks.view(FLOAT_DTYPES[kind]).reshape(-1, cols).float()
    return dequantize(kind, blocks, cols)


@dataclass(frozen=True, slots=True)
class GGUFBlocks:
    """A [rows, cols] weight in one stored format: blocks is uint8 [rows, row_bytes(kind, cols)]
    (float kinds included: their rows' raw bytes)."""

    kind: int  # ggml type id
    blocks: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    @property
    def is_float(self) -> bool:
        return self.kind in FLOAT_DTYPES

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    @property
    def shape(self) -> tuple[int, int]:
        return self.rows, self.cols

    def row_range(self, first: int, last: int) -> GGUFBlocks:
        """Rows [first, last), a view of the same bytes (one expert of a stacked tensor)."""
        return GGUFBlocks(self.kind, self.blocks[first:last], self.cols)

    def take_rows(self, index: torch.Tensor) -> GGUFBlocks:
        return GGUFBlocks(self.kind, self.blocks[index], self.cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], as gguf-py (and so transformers) computes it."""
        return dequantize_rows(self.kind, self.blocks, self.cols)
