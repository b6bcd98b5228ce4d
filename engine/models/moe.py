"""SparseMoE: the sparse mixture-of-experts MLP of Qwen3-MoE and Mixtral.

A router (`gate`, a linear layer to one logit per expert) picks each token's top-k experts by
softmax probability; each expert is a gated MLP (down(silu(gate(x)) * up(x))) of
moe_intermediate_size; the token's output is the routing-weighted sum of its k experts'
outputs. Computed as Hugging Face transformers 5 computes it by default (grouped_mm,
integrations/moe.py), rounding where it rounds:

    probs    = softmax(router logits in the model's dtype, in float32)
    weights  = top-k probs, divided by their sum when renormalized (Mixtral always, Qwen3-MoE
               when config.norm_topk_prob), cast to the model's dtype for Qwen3-MoE only
    output   = sum over the k picks, in top-k order, of expert output * weight

A step's (token, expert) pairs are sorted by expert once; each expert that was picked runs
one matmul over all its tokens' rows (gate_up), the activation runs once over every pair, then
one matmul per expert again (down). The weighted rows are summed per token over the picks in
fp32, rounded once: the reduction HF uses (an index_add_ into a bf16 output would round after
every add). In bf16 with the native kernels the routing is one native call (moe_route.cpp, the
same steps; its exp is not torch's, so a weight may differ from torch's in the last fp32 bit)
and all of the rest another (moe_experts.cpp: the sort, the gather, every active expert's two
products in one parallel region each, the weighted sum), the two calls the decode stack makes
too; elsewhere (float32, no kernels) the same steps in torch (_experts_in_torch).

Expert weights: all experts of a layer in one tensor per matrix, gate_up [E, 2 I, H] (gate
rows, then up rows) and down [E, H, I], in the serving dtype, filled at load one expert at a
time, in the layout the matmul reads: tiles (amx_pack_weight's layout per expert,
[E, N/16, K/32, 16, 16, 2]) when the native kernels serve bfloat16 and the sizes tile evenly,
read by amx_grouped_linear on an AMX CPU and by vector_grouped_linear's AVX512-BF16 products
elsewhere; else row-major (one F.linear per expert in torch). One layout only: the tiles also
serve one-row products (Qwen3-30B-A3B's expert shape, 2048 x 768, on this 2-core AMX CPU: 0.47 ms
per expert at 1 row, as small_batch_linear over row-major rows; F.linear 0.64 ms).

A GGUF file's experts (qwen3moe, Mixtral's llama files) are not copied into that layout: each
expert keeps its rows of the file's stacked [E, rows, cols] block tensors (load_gguf), as a
GGUFLinear for gate|up and one for down. In bf16 with the kernels a step's picked experts run
in one native call over the three stacked tensors (moe_experts_gguf: moe_experts' steps, each
expert's rows through gguf_linear's path for that many rows, so bit for bit the loop over the
GGUFLinears that _experts_in_torch runs elsewhere). One copy of the weights.

Measured, one bf16 layer on this 2-core AMX CPU (median of 15; tiles vs row-major F.linear):
Qwen3-30B-A3B's (128 experts of 768, top-8) 5.0 vs 7.3 ms at 1 token (8 experts run),
38 vs 54 ms at 8 (53), 103 vs 141 ms at 64 (124: 1.17 GB of experts, about the 12 GB/s these
two cores stream); Mixtral-8x7B's (8 of 14336, top-2) 35 vs 70 ms at 1 token, 148 vs 228 at
8, 203 vs 202 at 64. The layer is bound by the bytes of the experts it runs. With
moe_experts (2026-12-06), the bench's Qwen3-MoE layer (64 experts of 512, top-8, hidden 1024)
at 1 / 8 / 64 / 2,048 tokens: 1.7 / 6.7 / 10.7 / 85 ms, against 2.0 / 7.7 / 13.4 / 132 ms
through the torch steps over amx_grouped_linear. Without AMX (a 2-core Zen 4 EPYC),
vector_grouped_linear over the same tiles, the same layer from memory (24 layers' experts, in
turn) at 1 / 8 / 64 / 512 tokens: 0.8-0.9 / 4.4-4.5 / 7.5-8.3 / 34 ms, against 0.8-1.2 /
4.1-5.6 / 8.7-10.1 / 51-66 ms over row-major experts (its earlier layout, 4 x 4 dot products);
one token's 8 experts stream at what a plain read got that hour (≈ 29-30 GB/s).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn import functional as F

from engine.gguf_tensors import GGUFBlocks
from engine.models.gguf_linear import GGUFLinear
from engine.models.layer_ops import KernelLayerOps
from engine.models.packed_linear import SMALL_BATCH_ROWS

if TYPE_CHECKING:
    from engine.models.llama import LlamaShape

TILE_ROWS, TILE_DEPTH = 16, 32  # amx_pack_weight's tile: 16 output rows x 32 inputs

# An expert's (gate, up, down) checkpoint names, under <layer>.<block>.experts.<e>.: Qwen3-MoE
# (and transformers 5's save_pretrained of either family) and Mixtral's published checkpoints.
PER_EXPERT_NAMES = {
    "mlp": ("gate_proj", "up_proj", "down_proj"),
    "block_sparse_moe": ("w1", "w3", "w2"),
}


class SparseMoE(nn.Module):
    """Owns one layer's router and experts. forward(x [T, H]) -> [T, H]; after each forward,
    num_experts_run is how many distinct experts it ran (the meter's bytes: each one's weights
    were read once)."""

    def __init__(self, shape: LlamaShape, ops) -> None:
        super().__init__()
        self.hidden_size = shape.hidden_size
        self.intermediate_size = shape.moe_intermediate_size
        self.num_experts = shape.num_experts
        self.top_k = shape.num_experts_per_tok
        self.norm_topk_prob = shape.norm_topk_prob
        self.round_routing_weights = shape.round_routing_weights
        self.ops = ops
        self.gate = nn.Linear(shape.hidden_size, shape.num_experts, bias=False)
        size = (self.num_experts, 2 * self.intermediate_size, self.hidden_size)
        self.gate_up_proj = nn.Parameter(torch.empty(size), requires_grad=False)
        size = (self.num_experts, self.hidden_size, self.intermediate_size)
        self.down_proj = nn.Parameter(torch.empty(size), requires_grad=False)
        # Set by allocate(): the kernels when moe_experts runs the experts (bf16).
        self.kernels = None
        # A GGUF file's experts in their stored blocks (load_gguf): per expert, a GGUFLinear
        # for gate|up and one for down; gate_up_proj / down_proj are then empty. Not child
        # modules: the meter counts an expert's bytes once per expert run (bytes_per_expert),
        # not as layers every pass reads; prepare_gguf_modules picks their kernels.
        self.gguf_experts: tuple[tuple[GGUFLinear, GGUFLinear], ...] | None = None
        # The same experts as the file's three stacked tensors, and the kernels that run them
        # all in one native call (moe_experts_gguf; set by use_gguf_kernels in bf16).
        self.gguf_stacked: tuple[GGUFBlocks, GGUFBlocks, GGUFBlocks] | None = None
        self.gguf_kernels = None
        self.gguf_int8_activations = False
        self.num_experts_run = 0

    @property
    def tiled(self) -> bool:
        """Whether the experts are laid out as tiles: wherever moe_experts runs them (else
        row-major, for torch)."""
        return self.kernels is not None

    @property
    def bytes_per_expert(self) -> int:
        """Bytes of one expert's weights (the tiles hold the same values, re-laid out; a GGUF
        expert's stored blocks)."""
        if self.gguf_experts is not None:
            gate_up, down = self.gguf_experts[0]
            return gate_up.bytes_read(1) + down.bytes_read(1)
        numel = self.gate_up_proj.numel() + self.down_proj.numel()
        return numel // self.num_experts * self.gate_up_proj.element_size()

    @property
    def gguf_expert_params(self) -> int:
        """Weights the GGUF experts hold (parameters elsewhere count them)."""
        if self.gguf_experts is None:
            return 0
        return self.num_experts * 3 * self.intermediate_size * self.hidden_size

    # -- loading ----------------------------------------------------------------------------
    def load(
        self,
        prefix: str,
        read: Callable,
        has: Callable,
        dtype: torch.dtype,
        blocks: Callable | None = None,
    ) -> None:
        """Fill the experts from a checkpoint (our layer prefix "layers.<i>."), one expert at a
        time. The router is loaded by the model (ROUTER_NAMES). Three layouts on disk: HF's
        fused [E, 2I, H] / [E, H, I] tensors (each read whole, then copied expert by expert),
        one tensor per expert and matrix (published checkpoints; what transformers 5.24's
        save_pretrained writes), or a GGUF's gate, up and down tensors [E, I, H] / [E, H, I]
        (GGUF_EXPERT_NAMES; `blocks(name)` reads each once, as stored: WeightLoader.blocks)."""
        gguf = [f"{prefix}mlp.experts.{m}.weight" for m in GGUF_EXPERT_NAMES]
        if has(gguf[0]):  # only a GGUF's tensors get these names, so `blocks` reads them
            stored = [blocks(name) for name in gguf]
            if not all(b.is_float for b in stored):
                self.load_gguf(*stored, dtype)
                return
            self.allocate(dtype)  # float experts (an f32 / f16 file): into our layout
            gate, up, down = (b.dequantize().view(self.num_experts, -1, b.cols) for b in stored)
            for e in range(self.num_experts):
                self.load_expert(e, gate[e], up[e], down[e])
            return
        self.allocate(dtype)
        fused = f"{prefix}mlp.experts.gate_up_proj"
        if has(fused):
            gate_up, down = read(fused), read(f"{prefix}mlp.experts.down_proj")
            self._check(fused, gate_up, self.gate_up_proj_shape)
            self._check(f"{prefix}mlp.experts.down_proj", down, self.down_proj_shape)
            size = self.intermediate_size
            for e in range(self.num_experts):
                self.load_expert(e, gate_up[e, :size], gate_up[e, size:], down[e])
            return
        for block, matrices in PER_EXPERT_NAMES.items():
            if has(f"{prefix}{block}.experts.0.{matrices[0]}.weight"):
                break
        else:
            raise ValueError(f"experts missing from checkpoint: {prefix}mlp.experts.*")
        for e in range(self.num_experts):
            first = f"{prefix}{block}.experts.{e}."
            self.load_expert(e, *(read(f"{first}{m}.weight") for m in matrices))

    @property
    def gate_up_proj_shape(self) -> tuple[int, int, int]:
        return self.num_experts, 2 * self.intermediate_size, self.hidden_size

    @property
    def down_proj_shape(self) -> tuple[int, int, int]:
        return self.num_experts, self.hidden_size, self.intermediate_size

    def allocate(self, dtype: torch.dtype) -> None:
        """Real (unfilled) expert tensors in dtype, in the layout forward reads."""
        kernels = self.ops.kernels if isinstance(self.ops, KernelLayerOps) else None
        sizes = (2 * self.intermediate_size, self.hidden_size, self.intermediate_size)
        native = (
            dtype == torch.bfloat16
            and kernels is not None
            and all(s % TILE_DEPTH == 0 for s in sizes)
        )
        self.kernels = kernels if native else None
        for name, (e, n, k) in (
            ("gate_up_proj", self.gate_up_proj_shape),
            ("down_proj", self.down_proj_shape),
        ):
            tiles = (e, n // TILE_ROWS, k // TILE_DEPTH, TILE_DEPTH // 2, TILE_ROWS, 2)
            size = tiles if self.tiled else (e, n, k)
            tensor = torch.empty(size, dtype=dtype, device="cpu")
            setattr(self, name, nn.Parameter(tensor, requires_grad=False))

    def load_gguf(self, gate: GGUFBlocks, up: GGUFBlocks, down: GGUFBlocks, dtype) -> None:
        """A GGUF's experts kept in their stored blocks, one copy: each expert's linears are
        row ranges of the three tensors read (gate and up two parts of one GGUFLinear)."""
        size, hidden = self.intermediate_size, self.hidden_size
        for name, tensor, rows, cols in (
            ("gate", gate, size, hidden),
            ("up", up, size, hidden),
            ("down", down, hidden, size),
        ):
            self._check(f"experts' {name}", tensor, (self.num_experts * rows, cols))
        experts = []
        for e in range(self.num_experts):
            parts = [t.row_range(e * size, (e + 1) * size) for t in (gate, up)]
            gate_up = GGUFLinear(parts, hidden, None, dtype)
            down_e = GGUFLinear([down.row_range(e * hidden, (e + 1) * hidden)], size, None, dtype)
            experts.append((gate_up, down_e))
        self.gguf_experts = tuple(experts)
        self.gguf_stacked = (gate, up, down)
        self.kernels = None  # moe_experts reads tiles; these experts go through their GGUFLinears
        empty = torch.empty(0, dtype=dtype)
        self.gate_up_proj = nn.Parameter(empty, requires_grad=False)
        self.down_proj = nn.Parameter(empty.clone(), requires_grad=False)

    def use_gguf_kernels(self, kernels, int8_activations: bool) -> None:
        """bf16 with the native kernels: every GGUF expert of a step in one moe_experts_gguf
        call, when all three tensors are blocks (a float one keeps the GGUFLinears' loop)."""
        for pair in self.gguf_experts:
            for linear in pair:
                linear.use_kernels(kernels, False, int8_activations)
        if not any(b.is_float for b in self.gguf_stacked):
            self.gguf_kernels = kernels
            self.gguf_int8_activations = int8_activations

    def load_expert(self, e: int, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> None:
        """Write expert e's gate [I, H], up [I, H] and down [H, I] (any float dtype)."""
        size = self.intermediate_size
        self._write(self.gate_up_proj[e], 0, gate, (size, self.hidden_size))
        self._write(self.gate_up_proj[e], size, up, (size, self.hidden_size))
        self._write(self.down_proj[e], 0, down, (self.hidden_size, size))

    def _write(self, matrix: torch.Tensor, first_row: int, rows: torch.Tensor, want) -> None:
        """Rows [first_row, first_row + len(rows)) of one expert's matrix. In the tile layout
        a tile holds 16 rows, and first_row and len(rows) are multiples of 32 (allocate)."""
        self._check("expert matrix", rows, want)
        if not self.tiled:
            matrix[first_row : first_row + rows.shape[0]].copy_(rows)
            return
        tiles = self.kernels.amx_pack_weight(rows.to(torch.bfloat16).contiguous())
        first = first_row // TILE_ROWS
        matrix[first : first + tiles.shape[0]].copy_(tiles)

    @staticmethod
    def _check(name: str, tensor, want) -> None:
        if tuple(tensor.shape) != tuple(want):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(want)}")

    # -- forward ----------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, H] -> [T, H]: the router's top-k picks, then their experts, weighted and summed
        (natively in one call in bf16 with the kernels, else in torch)."""
        weights, picks = self._route(x)
        if self.kernels is not None:
            out, self.num_experts_run = self.kernels.moe_experts(
                x.contiguous(), picks, weights, self.gate_up_proj, self.down_proj
            )
            return out
        if self.gguf_kernels is not None:
            return self._gguf_experts_native(x, weights, picks)
        return self._experts_in_torch(x, weights, picks)

    def _gguf_experts_native(self, x: torch.Tensor, weights, picks) -> torch.Tensor:
        """The GGUF experts in one native call: each picked expert's rows through the path
        its GGUFLinears take for that many rows, so equal to _experts_in_torch over them."""
        gate, up, down = self.gguf_stacked
        out, self.num_experts_run = self.gguf_kernels.moe_experts_gguf(
            x.contiguous(),
            picks,
            weights,
            gate.blocks,
            gate.kind,
            up.blocks,
            up.kind,
            down.blocks,
            down.kind,
            self.num_experts,
            self.intermediate_size,
            small_rows=SMALL_BATCH_ROWS,
            int8_activations=self.gguf_int8_activations,
        )
        return out

    def _route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights, picks), both [T, k] in top-k order: weights float32, or in the model's
        dtype where the family rounds them (Qwen3-MoE). With the kernels, the same steps in one
        native call (moe_route, which the decode stack calls too)."""
        logits = self.gate.forward(x)
        kernels = self.kernels if self.kernels is not None else self.gguf_kernels
        if kernels is not None:
            return kernels.moe_route(
                logits.contiguous(), self.top_k, self.norm_topk_prob, self.round_routing_weights
            )
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, picks = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights /= weights.sum(dim=-1, keepdim=True)
        if self.round_routing_weights:
            weights = weights.to(logits.dtype)
        return weights, picks

    def _experts_in_torch(self, x: torch.Tensor, weights, picks) -> torch.Tensor:
        """The row-major experts, as moe_experts computes the tiled ones. Pair p = t * k + j
        is token t's j-th pick; `order` lists the pairs sorted by expert (stable), expert e's
        pairs at [offset_e, offset_e + count_e) of the sorted rows."""
        num_tokens, k = x.shape[0], self.top_k
        flat = picks.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, order // k)  # [T k, H], sorted by expert
        active = [(e, n) for e, n in enumerate(counts) if n]
        self.num_experts_run = len(active)
        if self.gguf_experts is None:
            gate_up = [lambda r, w=w: F.linear(r, w) for w in self.gate_up_proj]
            down = [lambda r, w=w: F.linear(r, w) for w in self.down_proj]
        else:
            gate_up, down = zip(*self.gguf_experts, strict=True)
        hidden = self.ops.silu_and_mul(_per_expert(gate_up, rows, active))
        out = _per_expert(down, hidden, active)
        weighted = out * weights.flatten().index_select(0, order).unsqueeze(1)
        by_pair = torch.empty_like(weighted).index_copy_(0, order, weighted)
        return by_pair.view(num_tokens, k, -1).sum(dim=1).to(x.dtype)


def _per_expert(linears, rows: torch.Tensor, active) -> torch.Tensor:
    """rows (sorted by expert) through their expert's linear, one call per active expert."""
    pieces, first = [], 0
    for e, n in active:
        pieces.append(linears[e](rows[first : first + n]))
        first += n
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


# A GGUF's expert tensors as gguf_checkpoint names them under <layer>.mlp.experts.
GGUF_EXPERT_NAMES = ("gate_exps", "up_exps", "down_exps")
# The router's checkpoint names under a layer: Qwen3-MoE and transformers 5, then Mixtral's.
ROUTER_NAMES = ("mlp.gate.weight", "block_sparse_moe.gate.weight")


def moe_layer_indices(config) -> frozenset[int]:
    """Layers of an HF config whose MLP is a sparse MoE block, as transformers decides:
    Mixtral every layer; Qwen3-MoE layer i unless i is in mlp_only_layers or
    (i + 1) % decoder_sparse_step != 0. Dense models: none."""
    num_experts = _num_experts(config)
    if not num_experts:
        return frozenset()
    dense = set(getattr(config, "mlp_only_layers", None) or ())
    step = getattr(config, "decoder_sparse_step", None) or 1
    layers = range(config.num_hidden_layers)
    return frozenset(i for i in layers if i not in dense and (i + 1) % step == 0)


def _num_experts(config) -> int:
    if config.model_type == "mixtral":
        return config.num_local_experts
    if config.model_type == "qwen3_moe":
        return config.num_experts
    return 0
