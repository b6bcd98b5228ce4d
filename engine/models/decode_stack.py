"""DecodeStack: a Llama model's decoder layers as one native call for small decode steps.

A decode-only step of a few rows (single- and few-stream serving, drafted decodes: 1-8 rows of
a GGUF model, 1-32 on an AMX CPU; 1-4 of a bf16 model) runs each layer's ~10 kernels from
Python: with the calls, their argument checks and the views between them, that is ≈ 1.3 ms of a
≈ 4.7 ms single-stream step. The native DecodeStack (engine/kernels/csrc/decode_stack.cpp) makes the
same kernel calls in the same order from C++: its output is bit-identical to
LlamaForCausalLM.forward's on the same step (tests/integration_engine/test_decode_stack.py), so
using it or not changes no token.

It applies only where every piece of such a step already runs on a native kernel: bfloat16,
the CPU-kernel layer ops and attention backend, bias-free linears whose small batches read
a GGUF file's blocks (GGUFLinear, gguf_linear) or a bf16 weight in the tile layout or row-major
(PackedLinear's small-batch path); Qwen3's per-head q/k norms run on the same kernel as in
the layer loop (rms_norm_heads); a mixture-of-experts layer's MLP is its router (such a
linear), moe_route and moe_experts (or moe_experts_gguf over a GGUF's stacked experts), the
calls SparseMoE.forward makes. Any other step, or model, takes the Python path.
"""

from __future__ import annotations

import torch

from engine.attention.cpu_kernel import CpuKernelAttention
from engine.attention.kv_cache import KVCacheTensors
from engine.attention.metadata import AttentionMetadata
from engine.models.gguf_linear import GGUFLinear
from engine.models.layer_ops import KernelLayerOps
from engine.models.moe import SparseMoE
from engine.models.packed_linear import SMALL_BATCH_ROWS, PackedLinear

DENSE_KIND = -1  # the native stack's kind for a PackedLinear's row-major bf16 weight
GGUF_PARTS_KIND = -2  # a GGUFLinear: its parts' (ggml type, rows, int8 activations), then blocks
TILES_KIND = -3  # a PackedLinear's tiles (amx_pack_weight), read by tile_small_linear
EXPERTS_KIND = -4  # a SparseMoE's experts and routing, in down's place (its router in gate_up's)
GGUF_EXPERTS_KIND = -5  # a SparseMoE's GGUF experts (stacked blocks) and routing, likewise


class DecodeStack:
    """Owns the native stack built over one model's weights and one KV cache allocation."""

    def __init__(self, native, kv_cache: KVCacheTensors, max_rows: int) -> None:
        self.native = native
        self.kv_cache = kv_cache
        self.max_rows = max_rows

    def takes(self, meta: AttentionMetadata, num_tokens: int, kv_cache: KVCacheTensors) -> bool:
        """Whether this step is one the stack runs: 1-max_rows decode rows over its own cache."""
        return (
            num_tokens <= self.max_rows
            and meta.num_decodes == num_tokens
            and meta.prefill_spans is None
            and kv_cache is self.kv_cache
        )

    def run(self, embeddings: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata):
        """Embeddings of the step's rows -> (final-normed hidden states, K/V written; the
        (layer, expert) pairs the step ran and their experts' bytes, 0 for a dense model)."""
        return self.native.run(
            embeddings,
            positions,
            meta.slot_mapping,
            meta.decode_block_tables,
            meta.decode_context_lens,
        )


def build_decode_stack(model, kv_cache: KVCacheTensors, kernels) -> DecodeStack | None:
    """The model's DecodeStack over kv_cache, or None where some piece of a small decode step
    would not run on the native kernels (the Python path then serves every step)."""
    if not _eligible(model, kernels):
        return None
    norms, linears = [], []
    for layer in model.layers:
        norms += [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
        attention = layer.self_attn
        if attention.q_norm is not None:  # Qwen3
            norms += [attention.q_norm.weight, attention.k_norm.weight]
        linears += [_linear_spec(linear) for linear in _linears(layer)[:2]]
        linears += _mlp_specs(layer.mlp)
    norms.append(model.norm.weight)
    shape = model.shape
    native = kernels.DecodeStack(
        [n.detach() for n in norms],
        linears,
        kv_cache.keys,
        kv_cache.values,
        model.rotary.cos,
        model.rotary.sin,
        shape.num_heads,
        shape.num_kv_heads,
        kv_cache.block_size,
        shape.rms_norm_eps,
        model.layers[0].self_attn.scale,
    )
    return DecodeStack(native, kv_cache, _max_rows(linears, native))


def _max_rows(linears, native) -> int:
    """The stack's row limit. With GGUF blocks in every linear, the native stack's own: 8 (above
    4 rows each block is dequantized to bf16 once for all rows; measured on AMD EPYC without
    AMX, SmolLM2 decode steps of 6 and 8 rows 9.5-11.3 and 10.5-11.7 ms, against 12.6-15.7 and
    14.0-14.6 ms on oneDNN's bf16 layout), 32 on an AMX CPU, where gguf_linear's tiles take 5-32
    rows, 16 for about the cost of 5 (a drafted decode, a step of 9-32 requests; GGUFLinear keeps
    such passes on the blocks too, so both paths agree bit for bit). A bf16 model (tiles, or
    row-major on AMX) stays at SMALL_BATCH_ROWS: its 5-8-row matvecs were not measured against
    the AMX tiles."""
    gguf = all(kind == GGUF_PARTS_KIND for kind, _ in linears)
    return native.max_rows if gguf else SMALL_BATCH_ROWS


def _eligible(model, kernels) -> bool:
    from engine.models.llama import LlamaForCausalLM

    if not isinstance(model, LlamaForCausalLM):  # the native stack runs Llama's layer only
        return False
    if not model.shape.plain_llama:  # no sliding window, no Granite multipliers
        return False
    shape = model.shape
    if kernels is None or model.dtype != torch.bfloat16:
        return False
    if not all(_native_experts(layer.mlp) for layer in model.layers):
        return False
    if shape.head_dim % 16 or shape.head_dim > 256:  # paged_decode_attention's head sizes
        return False
    if not isinstance(model.ops, KernelLayerOps):
        return False
    layers = list(model.layers)
    if not all(isinstance(layer.self_attn.backend, CpuKernelAttention) for layer in layers):
        return False
    return all(_small_batch_native(linear) for layer in layers for linear in _linears(layer))


def _linears(layer) -> tuple:
    """A decoder layer's linears in the native stack's order (a MoE layer's router for its
    MLP's)."""
    attention, mlp = layer.self_attn, layer.mlp
    if isinstance(mlp, SparseMoE):
        return attention.qkv_proj, attention.o_proj, mlp.gate
    return attention.qkv_proj, attention.o_proj, mlp.gate_up_proj, mlp.down_proj


def _native_experts(mlp) -> bool:
    """A dense MLP, or a SparseMoE whose experts moe_experts runs (bf16 tiles) or
    moe_experts_gguf (a GGUF's stacked blocks)."""
    return not isinstance(mlp, SparseMoE) or mlp.tiled or mlp.gguf_kernels is not None


def _mlp_specs(mlp) -> list:
    """The native stack's gate_up and down places: a dense MLP's linears, or a SparseMoE's
    router and (EXPERTS_KIND, its experts and routing)."""
    if not isinstance(mlp, SparseMoE):
        return [_linear_spec(mlp.gate_up_proj), _linear_spec(mlp.down_proj)]
    routing = [mlp.top_k, int(mlp.norm_topk_prob), int(mlp.round_routing_weights)]
    if mlp.gguf_kernels is not None:
        gate, up, down = mlp.gguf_stacked
        meta = [gate.kind, up.kind, down.kind, mlp.num_experts, mlp.intermediate_size]
        meta += [*routing, int(mlp.gguf_int8_activations), mlp.bytes_per_expert]
        meta.append(SMALL_BATCH_ROWS)  # as SparseMoE._gguf_experts_native passes it
        experts = [gate.blocks, up.blocks, down.blocks, torch.tensor(meta)]
        return [_linear_spec(mlp.gate), (GGUF_EXPERTS_KIND, experts)]
    routing.append(mlp.bytes_per_expert)
    experts = [mlp.gate_up_proj.detach(), mlp.down_proj.detach(), torch.tensor(routing)]
    return [_linear_spec(mlp.gate), (EXPERTS_KIND, experts)]


def _small_batch_native(linear) -> bool:
    """Whether a linear's small-batch product runs on a native kernel without bias."""
    if isinstance(linear, GGUFLinear):  # every part in stored blocks, read by gguf_linear
        float_part = any(isinstance(part, torch.Tensor) for part in linear.parts)
        return linear.bias is None and linear.kernels is not None and not float_part
    if not isinstance(linear, PackedLinear) or linear.bias is not None:
        return False
    return linear.tiles is not None or linear.weight is not None


def _linear_spec(linear: PackedLinear | GGUFLinear) -> tuple[int, list[torch.Tensor]]:
    if isinstance(linear, GGUFLinear):
        int8 = int(linear.int8_activations)
        parts = torch.tensor(
            [[part.kind, part.rows, int8] for part in linear.parts], dtype=torch.int64
        )
        return GGUF_PARTS_KIND, [parts, *(part.blocks for part in linear.parts)]
    if linear.tiles is not None:
        return TILES_KIND, [linear.tiles]
    return DENSE_KIND, [linear.weight]
