"""ggml's block formats: which GGUF tensor types are served from their stored bytes, and the
plain-torch dequantization every kernel over those bytes is tested against (STYLE 11).

A quantized GGUF tensor of [rows, cols] weights is rows independent byte rows, each cols /
block_weights blocks of block_bytes. Layouts (ggml-common.h; fp16 = IEEE half, little endian):

  Q4_0  32 w, 18 B: fp16 d, qs[16]                 w = d (q - 8)
  Q4_1  32 w, 20 B: fp16 d, fp16 m, qs[16]         w = d q + m
  Q5_0  32 w, 22 B: fp16 d, qh[4], qs[16]          w = d (q - 16)
  Q5_1  32 w, 24 B: fp16 d, fp16 m, qh[4], qs[16]  w = d q + m
        q[j] = qs[j] & 15 (j < 16), qs[j - 16] >> 4 (j >= 16); Q5: | bit j of qh (u32) << 4
  Q8_0  32 w, 34 B: fp16 d, int8 q[32]             w = d q
  Q4_K 256 w, 144 B: fp16 d, fp16 dmin, scales[12], qs[128]
        8 sub-blocks of 32, 6-bit scale sc[s] and min m[s] packed in `scales` (_k_scales);
        sub-block s = 2 g + t: q = (qs[32 g + l] >> 4 t) & 15;  w = d sc[s] q - dmin m[s]
  Q5_K 256 w, 176 B: fp16 d, fp16 dmin, scales[12], qh[32], qs[128]
        as Q4_K, q |= ((qh[l] >> s) & 1) << 4
  Q6_K 256 w, 210 B: ql[128], qh[64], int8 scales[16], fp16 d
        sub-block s of 32 (h = s / 4): q = ((ql[64 h + 32 (s % 2) + l] >> 4 ((s / 2) % 2)) & 15)
        | (((qh[32 h + l] >> 2 (s % 4)) & 3) << 4);  w = d scales[2 s + l / 16] (q - 32)

Every product above is exact in float32 (fp16's 11 significant bits times codes and 6-8-bit
scales stay within 24), so the only rounding is the one addition of m (Q4_1, Q5_1) or
subtraction of dmin m (K-quants); dequantize() rounds exactly there, as gguf-py does, and so
equals gguf.quants.dequantize bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_SERVED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K")
_ROWS_PER_PIECE = 2048  # dequantize() works on this many rows at a time: bounded temporaries


@dataclass(frozen=True, slots=True)
class BlockFormat:
    """One ggml block format: `block_weights` weights of a row in `block_bytes` bytes."""

    kind: int  # the ggml type id (gguf.GGMLQuantizationType)
    name: str
    block_weights: int
    block_bytes: int


def _format(name: str) -> BlockFormat:
    kind = GGMLQuantizationType[name]
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    return BlockFormat(int(kind), name, block_weights, block_bytes)


FORMATS: dict[int, BlockFormat] = {f.kind: f for f in map(_format, _SERVED)}


def is_supported(kind: int) -> bool:
    """Whether tensors of ggml type `kind` are served from their blocks (gguf_linear)."""
    return kind in FORMATS


def block_format(kind: int) -> BlockFormat:
    if kind not in FORMATS:
        name = GGMLQuantizationType(kind).name if kind in GGML_QUANT_SIZES else str(kind)
        raise ValueError(f"GGUF tensor type {name} is not supported (served: {', '.join(_SERVED)})")
    return FORMATS[kind]


def row_bytes(kind: int, cols: int) -> int:
    """Bytes of one row of `cols` weights; cols must be a whole number of blocks."""
    fmt = block_format(kind)
    if cols % fmt.block_weights:
        raise ValueError(
            f"{fmt.name} rows hold multiples of {fmt.block_weights} weights, not {cols}"
        )
    return cols // fmt.block_weights * fmt.block_bytes


def dequantize(kind: int, blocks: torch.Tensor, cols: int) -> torch.Tensor:
    """float32 [rows, cols] from uint8 blocks [rows, row_bytes(kind, cols)], equal to
    gguf.quants.dequantize bit for bit."""
    fmt = block_format(kind)
    width = row_bytes(kind, cols)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width:
        raise ValueError(f"{fmt.name} blocks must be uint8 [rows, {width}] for {cols} columns")
    rows = blocks.shape[0]
    out = torch.empty(rows, cols, dtype=torch.float32)
    for first in range(0, rows, _ROWS_PER_PIECE):
        piece = blocks[first : first + _ROWS_PER_PIECE]
        shaped = piece.reshape(piece.shape[0], -1, fmt.block_bytes)
        out[first : first + piece.shape[0]] = _DEQUANTIZE[fmt.name](shaped).reshape(-1, cols)
    return out


def int8_inputs(kind: int, x: torch.Tensor) -> torch.Tensor:
    """The inputs as gguf_linear's int8 path (EngineConfig.gguf_activations "int8") multiplies
    them: each block of the format's weights (256 for the K-quants, 32 for the others) of a row
    rounded to int8 q = round(x * 127 / max|x|) (nearest even), times max|x| / 127; float32."""
    group = block_format(kind).block_weights
    values = x.float().reshape(x.shape[0], -1, group)
    largest = values.abs().amax(dim=-1, keepdim=True)
    # A tensor divided by a tensor: torch computes number / tensor as a reciprocal times the
    # number, which rounds twice.
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest, 0.0)
    return (torch.round(values * inverse) * (largest / 127.0)).reshape(x.shape)


# Each takes uint8 [rows, blocks, block_bytes] and returns float32 [rows, blocks, weights].


def _fp16(field: torch.Tensor) -> torch.Tensor:
    """float32 [..., 1] from the two bytes [..., 2] of a little-endian fp16."""
    return field.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """32 4-bit codes from 16 bytes: low nibbles are elements 0-15, high nibbles 16-31."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(qh: torch.Tensor) -> torch.Tensor:
    """The 32 bits of a little-endian u32 [..., 4], bit j at element j, as 0/1 uint8."""
    shifts = torch.arange(8, dtype=torch.uint8)
    return ((qh.unsqueeze(-1) >> shifts) & 1).flatten(-2)


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[..., 2:]).float() - 8).mul_(_fp16(b[..., 0:2]))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[..., 4:]).float().mul_(_fp16(b[..., 0:2])).add_(_fp16(b[..., 2:4]))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 6:]) | (_bits(b[..., 2:6]) << 4)
    return (q.float() - 16).mul_(_fp16(b[..., 0:2]))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[..., 8:]) | (_bits(b[..., 4:8]) << 4)
    return q.float().mul_(_fp16(b[..., 0:2])).add_(_fp16(b[..., 2:4]))


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[..., 2:].contiguous().view(torch.int8).float().mul_(_fp16(b[..., 0:2]))


def _k_scales(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and 8 6-bit mins of a Q4_K/Q5_K super-block from its 12 bytes:
    bytes 0-3 hold sc[0-3] (low 6 bits) and sc[4-7]'s top 2 bits, 4-7 the same for the mins,
    8-11 the low 4 bits of sc[4-7] (low nibble) and m[4-7] (high nibble)."""
    lo, mid, hi = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([lo & 63, (hi & 15) | ((lo >> 2) & 48)], dim=-1)
    mins = torch.cat([mid & 63, (hi >> 4) | ((mid >> 2) & 48)], dim=-1)
    return scales.float(), mins.float()


def _k_low_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[..., 8, 32] 4-bit codes of Q4_K/Q5_K: sub-block 2 g + t = nibble t of qs[32 g:32 g + 32]."""
    groups = qs.unflatten(-1, (4, 1, 32)) >> torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    return (groups & 15).flatten(-3, -2)


def _k_weights(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    sc, m = _k_scales(b[..., 4:16])
    d, dmin = _fp16(b[..., 0:2]), _fp16(b[..., 2:4])
    w = q.float().mul_((d * sc).unsqueeze(-1)).sub_((dmin * m).unsqueeze(-1))
    return w.flatten(-2)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_weights(b, _k_low_nibbles(b[..., 16:144]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, dtype=torch.uint8).view(8, 1)
    high = (b[..., 16:48].unsqueeze(-2) >> shifts) & 1  # [..., 8, 32]: bit s of qh[l]
    return _k_weights(b, _k_low_nibbles(b[..., 48:176]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    four = torch.tensor([0, 4], dtype=torch.uint8).view(2, 1)
    low = ((b[..., 0:128].unflatten(-1, (2, 1, 64)) >> four) & 15).flatten(-3)  # [..., 256]
    twos = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(4, 1)
    high = ((b[..., 128:192].unflatten(-1, (2, 1, 32)) >> twos) & 3).flatten(-3)
    q = (low | (high << 4)).float().sub_(32).unflatten(-1, (16, 16))
    scales = b[..., 192:208].contiguous().view(torch.int8).float()
    return q.mul_((_fp16(b[..., 208:210]) * scales).unsqueeze(-1)).flatten(-2)


_DEQUANTIZE = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
