"""GGUFLinear and GGUFEmbedding: a GGUF model's weights served in the file's own block formats.

A GGUFLinear owns one linear layer's weight as row ranges ("parts"), each in one stored format:
a fused q|k|v or gate|up whose parts share a format is one part; where they differ (Q4_K_M
files keep some v and down projections in Q6_K) each run of one format is a part and the
outputs are concatenated. prepare_gguf_modules() picks the path once, at load:
- bfloat16 with the native kernels: kernels.gguf_linear reads each part's blocks as stored, at
  every number of rows (no float copy of the weight exists); a float part (F32/F16/BF16 in the
  file) is kept in the model's dtype and multiplied by F.linear;
- float32 with the AVX2 kernels (any x86 CPU with AVX2 + FMA + F16C: the dtype "auto" picks
  on CPUs without AVX512-BF16): 1-8 rows read the blocks with avx2.gguf_matvec_f32, 9-64 with
  avx2.gguf_panel_f32 (the exact weights, fp32 sums; up to 128 for a part of 8 MiB or more in
  float32, AVX2_LARGE_PART_BYTES); larger passes dequantize the part per
  call (gguf_dequantize_f32, equal to the reference) and multiply with F.linear, so only the
  blocks stay resident;
- EngineConfig.gguf_activations "int8" (either of the two above): passes of 1-8 rows quantize
  their inputs to int8 and multiply the stored codes by them in integers (as llama.cpp does),
  instead of multiplying the exact weights (kernels.gguf_linear, or avx2.gguf_matvec_int8 in
  float32); larger passes are unchanged;
- otherwise (no kernels, or EngineConfig.gguf_matvec off): the layer becomes a plain
  nn.Linear whose weight is the blocks dequantized once into the model's dtype
  (engine/gguf_blocks.py's dequantize, equal to gguf-py's), the blocks dropped; in bfloat16
  the runner then packs it like any bf16 layer. Each layer holds one copy.
A GGUFLinear that was never prepared dequantizes its parts on every call (the plain reference).

GGUFEmbedding keeps a quantized token embedding as blocks and dequantizes only the rows a step
looks up; a tied LM head is a GGUFLinear over the same blocks tensor (one copy for both).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from engine.gguf_tensors import GGUFBlocks
from engine.models import packed_linear
from engine.models.packed_linear import PackedLinear

# float32 on the AVX2 kernels: 9 to this many rows take the panel kernel (each 4-row weight panel
# dequantized once per call into a thread's buffer); more dequantize the part per call for
# torch's matmul. Measured on a 2-core AMD EPYC (Zen 3), Q4_1 1536x576 and 576x1536: the panels
# are 0.9-0.6x the time of that at 9-64 rows, about equal at 128, 1.15x at 512.
AVX2_PANEL_ROWS = 64
# A part whose float32 copy takes at least AVX2_LARGE_PART_BYTES keeps the panels up to
# AVX2_LARGE_PART_PANEL_ROWS: writing such a copy costs more than the panels' extra arithmetic.
# Measured on the same CPU, a random 1.5B Llama Q4_K_M (parts of 16-92 MB in float32): a
# 128-token prefill 6.4-6.9 s with the copy, 3.2 s on the panels; 512 tokens about equal.
AVX2_LARGE_PART_BYTES = 8 << 20
AVX2_LARGE_PART_PANEL_ROWS = 128


class GGUFLinear(nn.Module):
    """y = x W^T (+ bias), W = the parts stacked by rows ([out_features, in_features])."""

    def __init__(
        self, parts: list[GGUFBlocks], in_features: int, bias: nn.Parameter | None, dtype
    ) -> None:
        super().__init__()
        if any(p.cols != in_features for p in parts):
            raise ValueError(f"GGUF weight parts of {[p.cols for p in parts]} != {in_features}")
        self.in_features = in_features
        self.out_features = sum(p.rows for p in parts)
        self.parts = tuple(parts)
        self.bias = bias
        self.dtype = dtype
        self.kernels = None  # set by use_kernels(); None: dequantize per call
        self.avx2 = None  # set by use_avx2_kernels() (float32)
        # Set by use_kernels(), 0 without AMX: the rows gguf_linear's AMX tiles take (wide_rows)
        # and, of those, the rows the decode stack runs on them (tile_rows).
        self.tile_rows = self.wide_rows = 0
        # With a bf16 copy (EngineConfig.gguf_large_batch "bf16", or "auto" without AMX): the
        # weight dequantized to bf16 once, in the large-batch layout of a bf16 layer, for passes
        # of more rows than blocks_rows() (without AMX the AVX512-BF16 panels are slower than it).
        self.large: PackedLinear | None = None
        # Set by engine/batch_invariance.py: every row count on the block panels (weights
        # rounded to bf16 as for large batches), whose per-row sums do not depend on the others.
        self.panels_only = False
        # Set by use_kernels(): small passes quantize their inputs to int8 (module docstring).
        self.int8_activations = False

    def use_kernels(
        self, kernels, large_batch_bf16: bool = False, int8_activations: bool = False
    ) -> None:
        """Read the blocks with kernels.gguf_linear from now on; float parts in the dtype.
        large_batch_bf16: also keep a bf16 copy for large batches (see self.large).
        int8_activations: passes of up to SMALL_BATCH_ROWS rows quantize their inputs."""
        self.kernels = kernels
        self.int8_activations = int8_activations
        self.parts = tuple(_float_part_in(p, self.dtype) for p in self.parts)
        amx = kernels.amx_available()
        self.tile_rows = kernels.GGUF_TILE_ROWS if amx else 0
        self.wide_rows = kernels.GGUF_WIDE_TILE_ROWS if amx else 0
        if large_batch_bf16:
            self.large = PackedLinear(self.to_linear(), kernels)
            self.large.weight = None  # its row-major copy: small batches read the blocks

    def use_avx2_kernels(self, avx2, int8_activations: bool = False) -> None:
        """float32: read the blocks with the AVX2 kernels from now on; float parts in float32.
        int8_activations: passes of up to avx2.max_rows rows quantize their inputs."""
        self.avx2 = avx2
        self.int8_activations = int8_activations
        self.parts = tuple(_float_part_in(p, self.dtype) for p in self.parts)

    def to_linear(self) -> nn.Linear:
        """An nn.Linear holding this weight dequantized into the dtype (one part's float32
        temporary at a time) and the same bias."""
        with torch.device("meta"):
            linear = nn.Linear(self.in_features, self.out_features, bias=False)
        weight = torch.empty(self.out_features, self.in_features, dtype=self.dtype)
        first = 0
        for part in self.parts:
            rows = part.shape[0] if isinstance(part, torch.Tensor) else part.rows
            weight[first : first + rows] = _dequantized(part)
            first += rows
        linear.weight = nn.Parameter(weight, requires_grad=False)
        linear.bias = self.bias
        return linear

    @property
    def num_params(self) -> int:
        return self.out_features * self.in_features

    def bytes_read(self, num_rows: int = 1) -> int:
        """Weight (and bias) bytes one forward over num_rows rows streams."""
        if self._large_path(num_rows):
            return self.large.bytes_read(num_rows)
        bias = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        weights = sum(_part_bytes(p) for p in self.parts)
        # A part dequantized per call: the matmul also reads its float32 weights.
        blocks = (p for p in self.parts if not isinstance(p, torch.Tensor))
        weights += sum(_float_bytes(p) for p in blocks if self._avx2_dequantizes(num_rows, p))
        return weights + bias

    def _avx2_dequantizes(self, num_rows: int, part: GGUFBlocks) -> bool:
        """Whether the AVX2 path dequantizes this part per call for num_rows rows (else the
        matvec or the panels read its blocks)."""
        if self.avx2 is None or num_rows <= AVX2_PANEL_ROWS:
            return False
        large = _float_bytes(part) >= AVX2_LARGE_PART_BYTES
        return not large or num_rows > AVX2_LARGE_PART_PANEL_ROWS

    def blocks_rows(self) -> int:
        """The most rows a pass reads from the blocks while a bf16 copy exists: on AMX the tiles
        take up to GGUF_WIDE_TILE_ROWS (a drafted decode, a decode step of 9-64 requests),
        reading a quarter of the copy's bytes for the time of the copy (135M Q4_1, offline
        64 x 128/128 on a 2-core AMX Xeon: 64-row decode steps 44-49 ms on either); without AMX
        the small-batch kernels' SMALL_BATCH_ROWS."""
        return max(packed_linear.SMALL_BATCH_ROWS, self.wide_rows)

    def _large_path(self, num_rows: int) -> bool:
        return self.large is not None and num_rows > self.blocks_rows()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self._large_path(flat.shape[0]):
            return self.large(x)
        outs = [self._part(flat, p) for p in self.parts]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def _part(self, flat: torch.Tensor, part: GGUFBlocks | torch.Tensor) -> torch.Tensor:
        if isinstance(part, torch.Tensor):
            return F.linear(flat, part)
        if self.avx2 is not None:
            return self._avx2_part(flat, part)
        if self.kernels is None:
            return F.linear(flat, part.dequantize().to(flat.dtype))
        # Single calls take the small-batch kernel up to packed_linear.SMALL_BATCH_ROWS rows,
        # as bf16 layers do: a 5-8-token prompt then rounds as it does batched with others
        # (the decode stack alone runs 5-8 decode rows on it).
        small = 0 if self.panels_only else packed_linear.SMALL_BATCH_ROWS
        return self.kernels.gguf_linear(
            flat.contiguous(),
            part.blocks,
            part.kind,
            part.rows,
            small_rows=small,
            int8_activations=self.int8_activations,
        )

    def _avx2_part(self, flat: torch.Tensor, part: GGUFBlocks) -> torch.Tensor:
        rows = flat.shape[0]
        if rows <= self.avx2.max_rows:
            matvec = (
                self.avx2.gguf_matvec_int8 if self.int8_activations else self.avx2.gguf_matvec_f32
            )
            return matvec(flat.contiguous(), part.blocks, part.kind, part.rows)
        if not self._avx2_dequantizes(rows, part):
            return self.avx2.gguf_panel_f32(flat.contiguous(), part.blocks, part.kind, part.rows)
        weight = self.avx2.gguf_dequantize_f32(part.blocks, part.kind, part.rows, part.cols)
        return F.linear(flat, weight)


class GGUFEmbedding(nn.Module):
    """Token embedding kept as stored blocks; forward dequantizes the looked-up rows only."""

    def __init__(self, table: GGUFBlocks, dtype) -> None:
        super().__init__()
        self.table = table
        self.dtype = dtype
        self.num_embeddings, self.embedding_dim = table.rows, table.cols

    @property
    def num_params(self) -> int:
        return self.num_embeddings * self.embedding_dim

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = self.table.take_rows(input_ids.reshape(-1)).dequantize().to(self.dtype)
        return rows.reshape(*input_ids.shape, self.embedding_dim)


def prepare_gguf_modules(
    model: nn.Module,
    kernels,
    dtype,
    large_batch_bf16: bool = False,
    avx2=None,
    int8_activations: bool = False,
) -> int:
    """Pick every GGUFLinear's path (module docstring): kernels.gguf_linear in bfloat16 when
    `kernels` has it (with a bf16 copy for large batches when large_batch_bf16, small passes
    on int8 inputs when int8_activations), the `avx2` kernels in float32 (small passes on int8
    inputs when int8_activations), else an nn.Linear of the dequantized weight, swapped in one layer at a
    time. Returns how many layers read their blocks."""
    native = dtype == torch.bfloat16 and kernels is not None and hasattr(kernels, "gguf_linear")
    avx2 = avx2 if dtype == torch.float32 else None
    parents = [m for m in model.modules() if any(isinstance(c, GGUFLinear) for c in m.children())]
    count = 0
    for parent in parents:
        for name, child in list(parent.named_children()):
            if not isinstance(child, GGUFLinear):
                continue
            if native:
                child.use_kernels(kernels, large_batch_bf16, int8_activations)
                count += 1
            elif avx2 is not None:
                child.use_avx2_kernels(avx2, int8_activations)
                count += 1
            else:
                setattr(parent, name, child.to_linear())
    for module in model.modules():  # a GGUF's experts (SparseMoE.gguf_experts): blocks kept
        experts = getattr(module, "gguf_experts", None)
        if experts is None:
            continue
        if native:
            module.use_gguf_kernels(kernels, int8_activations)
        elif avx2 is not None:
            for linear in (x for pair in experts for x in pair):
                linear.use_avx2_kernels(avx2, int8_activations)
        # else: dequantized per call (no float copy of every expert)
    return count


def _float_part_in(part: GGUFBlocks, dtype) -> GGUFBlocks | torch.Tensor:
    return part.dequantize().to(dtype) if part.is_float else part


def _dequantized(part: GGUFBlocks | torch.Tensor) -> torch.Tensor:
    return part if isinstance(part, torch.Tensor) else part.dequantize()


def _float_bytes(part: GGUFBlocks) -> int:
    return part.rows * part.cols * 4


def _part_bytes(part: GGUFBlocks | torch.Tensor) -> int:
    if isinstance(part, torch.Tensor):
        return part.numel() * part.element_size()
    return part.nbytes
