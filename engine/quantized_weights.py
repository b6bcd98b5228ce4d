"""GGUF weights kept in their stored block format, for decode-time matrix-vector products.

A GGUF checkpoint is served from its float conversion (engine/loader.py), which is what every
batch larger than a few rows multiplies with. Single-stream decode, though, is bound by how many
weight bytes each token streams from memory: the Q4_1 blocks are a quarter of bf16's bytes and
hold the exact values the float conversion was made from. So for a GGUF model the loader also
keeps each linear weight's raw blocks, renamed and row-permuted to Hugging Face's layout, and
checks at load time that they dequantize to exactly the converted float weights; any mismatch
drops them (the float path then serves alone).

Block formats (ggml), 32 weights per block along the input dimension, rows independent:
  Q4_1: 20 bytes = fp16 d, fp16 m, 16 bytes qs;  w[j] = d * q[j] + m,
        q[j] = qs[j] & 15 for j < 16,  qs[j - 16] >> 4 for j >= 16
  Q8_0: 34 bytes = fp16 d, 32 int8 q;             w[j] = d * q[j]
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}

# GGUF tensor names (llama.cpp) -> Hugging Face parameter names, for the Llama family.
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.weight")


@dataclass(frozen=True, slots=True)
class QuantizedTensor:
    """A [rows, cols] weight as ggml blocks: blocks is uint8 [rows, cols / 32 * block bytes]."""

    kind: str  # "q4_1" or "q8_0"
    blocks: torch.Tensor
    cols: int

    @property
    def rows(self) -> int:
        return self.blocks.shape[0]

    def take_rows(self, index: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.kind, self.blocks[index].contiguous(), self.cols)

    @staticmethod
    def concat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        """Rows of `parts` stacked, as a fused weight (q|k|v, gate|up) stacks them."""
        kinds, cols = {p.kind for p in parts}, {p.cols for p in parts}
        if len(kinds) != 1 or len(cols) != 1:
            raise ValueError("cannot fuse weights of different block formats or widths")
        return QuantizedTensor(parts[0].kind, torch.cat([p.blocks for p in parts]), parts[0].cols)

    def dequantize(self) -> torch.Tensor:
        """float32 [rows, cols], computed as gguf-py (and so transformers) computes it."""
        blocks = self.blocks.view(self.rows, -1, BLOCK_BYTES[self.kind])
        d = blocks[..., 0:2].contiguous().view(torch.float16).float()
        if self.kind == "q8_0":
            q = blocks[..., 2:].contiguous().view(torch.int8).float()
            return (q * d).reshape(self.rows, self.cols)
        m = blocks[..., 2:4].contiguous().view(torch.float16).float()
        qs = blocks[..., 4:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return (d * q + m).reshape(self.rows, self.cols)


@dataclass(frozen=True, slots=True)
class RepackedWeight:
    """The layout engine/kernels' quantized_linear reads (see quantized_linear.cpp).

    codes: Q4_1 uint8 [rows, cols / 2] (ggml nibble order), Q8_0 int8 [rows, cols];
    scales: float32 [rows, cols / 32] (d); mins: float32 m - 128 d (Q4_1; the kernel reads
    each code as 128 + q), None for Q8_0.
    """

    kind_id: int  # 0 = Q4_1, 1 = Q8_0 (the kernel's QuantKind)
    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None


def repack(weight: QuantizedTensor) -> RepackedWeight:
    blocks = weight.blocks.view(weight.rows, -1, BLOCK_BYTES[weight.kind])
    scales = blocks[..., 0:2].contiguous().view(torch.float16).float().reshape(weight.rows, -1)
    if weight.kind == "q8_0":
        codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(weight.rows, -1)
        return RepackedWeight(1, codes, scales, None)
    mins = blocks[..., 2:4].contiguous().view(torch.float16).float().reshape(weight.rows, -1)
    mins = mins - 128 * scales
    codes = blocks[..., 4:].contiguous().reshape(weight.rows, -1)
    return RepackedWeight(0, codes, scales, mins)


def read_quantized_weights(
    gguf_path: Path, config, float_weights: Mapping[str, torch.Tensor]
) -> dict[str, QuantizedTensor]:
    """HF name -> QuantizedTensor for every Q4_1/Q8_0 linear weight of a Llama-family GGUF.

    Only weights that dequantize bit-exactly to `float_weights`' conversion are returned.
    """
    if config.model_type not in ("llama", "mistral"):
        return {}  # other families' GGUF layouts are not mapped here
    from gguf import GGUFReader

    found: dict[str, QuantizedTensor] = {}
    for tensor in GGUFReader(str(gguf_path)).tensors:
        kind = tensor.tensor_type.name.lower()
        name = _hf_name(tensor.name)
        if kind not in BLOCK_BYTES or name is None:
            continue
        weight = QuantizedTensor(kind, _read_blocks(gguf_path, tensor), int(tensor.shape[0]))
        found[name] = _undo_rope_permutation(weight, tensor.name, config)
    return {name: w for name, w in found.items() if _matches(name, w, float_weights)}


def _read_blocks(gguf_path: Path, tensor) -> torch.Tensor:
    """A tensor's bytes read from the file (not through the reader's memory map, whose touched
    pages would count toward this process's resident memory until the reader is gone)."""
    data = np.fromfile(gguf_path, dtype=np.uint8, count=tensor.n_bytes, offset=tensor.data_offset)
    return torch.from_numpy(data.reshape(tensor.data.shape))


def _hf_name(gguf_name: str) -> str | None:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        return None
    return f"model.layers.{match.group(1)}.{_LAYER_NAMES[match.group(2)]}.weight"


def _undo_rope_permutation(weight: QuantizedTensor, gguf_name: str, config) -> QuantizedTensor:
    """llama.cpp stores q/k rows interleaved for its RoPE; transformers' reader undoes it
    (reverse_permute: rows [head, dim, 2] -> [head, 2, dim]); do the same to whole rows."""
    if ".attn_q." in gguf_name:
        heads = config.num_attention_heads
    elif ".attn_k." in gguf_name:
        heads = config.num_key_value_heads
    else:
        return weight
    half = weight.rows // heads // 2
    order = torch.arange(weight.rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)
    return weight.take_rows(order)


def _matches(name: str, weight: QuantizedTensor, float_weights: Mapping[str, torch.Tensor]) -> bool:
    reference = float_weights.get(name)
    if reference is not None and _equal_by_rows(weight, reference):
        return True
    log.warning("GGUF blocks of %s do not match its float conversion; not used", name)
    return False


def _equal_by_rows(weight: QuantizedTensor, reference: torch.Tensor, rows: int = 1024) -> bool:
    """weight.dequantize() == reference, compared `rows` rows at a time: dequantizing a whole
    embedding at once takes a few float32 copies of it."""
    if tuple(reference.shape) != (weight.rows, weight.cols):
        return False
    for first in range(0, weight.rows, rows):
        part = QuantizedTensor(weight.kind, weight.blocks[first : first + rows], weight.cols)
        if not torch.equal(part.dequantize(), reference[first : first + rows].float()):
            return False
    return True
