"""The Gemma family (Gemma 2, Gemma 3 text) over the paged cache, computed as transformers 5 does.

What differs from the Llama family (engine/models/llama.py), all read from the HF config:
- the embedding output is scaled by sqrt(hidden_size), that factor first rounded to the model
  dtype (HF's normalizer is a tensor of the hidden dtype: 55.4256 becomes 55.5 in bf16);
- Gemma's RMSNorm scales by (1 + weight) in float32 and casts after (Llama casts, then scales);
  four per layer, each branch normed on both sides before it joins the residual:
      h = h + post_attention_norm(attention(input_norm(h)))
      h = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))
- a GeLU-tanh gated MLP (hidden_activation gelu_pytorch_tanh);
- attention scaled by query_pre_attn_scalar**-0.5, sliding-window and full layers alternating
  as config.layer_types names them (engine/sliding_windows.py);
- Gemma 2: attention scores soft-capped (attn_logit_softcapping); Gemma 3: q and k normed per
  head before RoPE, and RoPE parameters per layer type (transformers 5 keys rope_parameters by
  "sliding_attention" / "full_attention": the local base, and the global one with its scaling);
  HF's Gemma 3 attention never applies attn_logit_softcapping, so neither do we;
- final logits soft-capped when final_logit_softcapping is set (Gemma 3 usually leaves it None);
- tied embeddings by default.
Weights keep Hugging Face names except q/k/v and gate/up, fused at load time as in llama.py.

The norms run in plain torch with either layer ops: the native rms_norm kernels implement
Llama's rounding order, which differs from Gemma's in bf16. Rotary embedding uses the layer
ops (kernels or torch, the same arithmetic as HF's), and attention the backend with each layer's
window and softcap. The native decode stack is Llama-only (decode_stack._eligible).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.models.layer_ops import RotaryInputs, TorchLayerOps
from engine.models.layers import RotaryEmbedding
from engine.models.weight_loader import WeightLoader, fuse
from engine.sliding_windows import layer_windows

# hidden_activation -> torch's gelu `approximate` argument (HF's ACT2FN names).
GELU_APPROXIMATIONS = {"gelu_pytorch_tanh": "tanh", "gelu_new": "tanh", "gelu": "none"}
UNSUPPORTED_ROPE_TYPES = ("longrope",)  # as engine/loader.py: its factor follows the length
LAYER_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


@dataclass(frozen=True, slots=True)
class GemmaShape:
    """The sizes and flags that define one model of the family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    qk_norm: bool  # Gemma 3
    attention_scale: float  # query_pre_attn_scalar**-0.5
    attn_softcap: float | None  # Gemma 2's attn_logit_softcapping
    final_softcap: float | None  # final_logit_softcapping
    gelu_approximate: str
    windows: tuple[int | None, ...]  # per layer: its sliding window, None for full attention
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, config) -> GemmaShape:
        _check_supported(config)
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        gemma3 = config.model_type == "gemma3_text"
        activation = getattr(config, "hidden_activation", None) or getattr(
            config, "hidden_act", "gelu_pytorch_tanh"
        )
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            qk_norm=gemma3,
            attention_scale=float(config.query_pre_attn_scalar) ** -0.5,
            attn_softcap=None if gemma3 else getattr(config, "attn_logit_softcapping", None),
            final_softcap=getattr(config, "final_logit_softcapping", None),
            gelu_approximate=GELU_APPROXIMATIONS[activation],
            windows=layer_windows(config),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", True)),
        )


def _check_supported(config) -> None:
    """Refuse what this module would compute differently from HF, rather than serve it wrong."""
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("Gemma with use_bidirectional_attention (an encoder) is not supported")
    if getattr(config, "attention_bias", False):
        raise ValueError("Gemma with attention_bias is not supported")
    activation = getattr(config, "hidden_activation", None) or getattr(
        config, "hidden_act", "gelu_pytorch_tanh"
    )
    if activation not in GELU_APPROXIMATIONS:
        raise ValueError(f"Gemma hidden_activation {activation!r} is not supported")


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + w), all in float32, cast to x's dtype last (HF's Gemma order).

    `weight` holds 1 + w in float32, made at load time from the checkpoint's w rounded to the
    serving dtype first, which is what HF's `1.0 + self.weight.float()` reads (load_weights).
    """

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # One fused op, bit-identical on CPU to HF's x * rsqrt(mean(x^2) + eps) * (1 + w).
        normed = nn.functional.rms_norm(x.float(), (x.shape[-1],), self.weight, self.eps)
        return normed.to(x.dtype)


class GeluGatedMLP(nn.Module):
    """down(gelu(gate(x)) * up(x)); gate and up are one fused matmul."""

    def __init__(self, hidden_size: int, intermediate_size: int, approximate: str) -> None:
        super().__init__()
        self.approximate = approximate
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj.forward(x).chunk(2, dim=-1)
        activated = nn.functional.gelu(gate, approximate=self.approximate)
        return self.down_proj.forward(activated * up)


class GemmaAttention(nn.Module):
    def __init__(self, shape: GemmaShape, layer: int, backend, ops) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(shape.hidden_size, q_size + 2 * kv_size, bias=False)
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = GemmaRMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = shape.attention_scale
        self.sliding_window = shape.windows[layer]
        self.softcap = shape.attn_softcap
        self.backend = backend
        self.ops = ops

    def forward(self, hidden, rope: RotaryInputs, key_cache, value_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        q_size, kv_size, _ = self.split_sizes
        if self.q_norm is not None:
            # Gemma 3 normalizes each q and k head before RoPE; written back so q and k stay
            # adjacent in qkv and rotate together below.
            q = qkv[:, :q_size].unflatten(1, (-1, self.head_dim))
            qkv[:, :q_size] = self.q_norm.forward(q).flatten(1)
            k = qkv[:, q_size : q_size + kv_size].unflatten(1, (-1, self.head_dim))
            qkv[:, q_size : q_size + kv_size] = self.k_norm.forward(k).flatten(1)
        qk = self.ops.rotate_heads(qkv, rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q,
            k,
            v,
            key_cache,
            value_cache,
            meta,
            self.scale,
            sliding_window=self.sliding_window,
            softcap=self.softcap,
        )
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class GemmaDecoderLayer(nn.Module):
    def __init__(self, shape: GemmaShape, layer: int, rope_key: str, backend, ops) -> None:
        super().__init__()
        norm = (shape.hidden_size, shape.rms_norm_eps)
        self.input_layernorm = GemmaRMSNorm(*norm)
        self.self_attn = GemmaAttention(shape, layer, backend, ops)
        self.post_attention_layernorm = GemmaRMSNorm(*norm)
        self.pre_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.mlp = GeluGatedMLP(shape.hidden_size, shape.intermediate_size, shape.gelu_approximate)
        self.post_feedforward_layernorm = GemmaRMSNorm(*norm)
        self.rope_key = rope_key  # which of the model's RoPE tables this layer rotates with

    def forward(self, hidden, rope, key_cache, value_cache, meta):
        normed = self.input_layernorm.forward(hidden)
        attended = self.self_attn.forward(normed, rope, key_cache, value_cache, meta)
        hidden = hidden + self.post_attention_layernorm.forward(attended)
        mlp = self.mlp.forward(self.pre_feedforward_layernorm.forward(hidden))
        return hidden + self.post_feedforward_layernorm.forward(mlp)


class GemmaForCausalLM(nn.Module):
    """forward() returns final hidden states; compute_logits() runs the LM head (soft-capped)
    on chosen rows. The same interface as LlamaForCausalLM.

    Parameters stay on the meta device until load_weights() (the RoPE tables are real)."""

    def __init__(self, config, backend, max_positions: int, dtype: torch.dtype, ops=None) -> None:
        super().__init__()
        self.shape = shape = GemmaShape.from_config(config)
        self.dtype = dtype
        self.ops = ops = ops or TorchLayerOps()
        rope_keys = _rope_keys(config)
        with torch.device("meta"):
            # _weight skips normal_() init: see LlamaForCausalLM.
            size = (shape.vocab_size, shape.hidden_size)
            self.embed_tokens = nn.Embedding(*size, _weight=torch.empty(size))
            self.layers = nn.ModuleList(
                GemmaDecoderLayer(shape, i, rope_keys[i], backend, ops)
                for i in range(shape.num_layers)
            )
            self.norm = GemmaRMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rotary = nn.ModuleDict(
            {
                key: _rotary_table(config, key, shape.head_dim, max_positions, dtype)
                for key in dict.fromkeys(rope_keys)
            }
        )
        # HF multiplies by sqrt(hidden_size) rounded to the model's dtype.
        self.register_buffer(
            "embed_scale", torch.tensor(shape.hidden_size**0.5).to(dtype), persistent=False
        )
        self.decode_stack = None  # the native decode stack serves the Llama family only

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        hidden = self.embed_tokens.forward(input_ids) * self.embed_scale
        ropes = {
            key: self.ops.rotary_inputs(table, positions) for key, table in self.rotary.items()
        }
        for layer, key_cache, value_cache in zip(
            self.layers, kv_cache.keys, kv_cache.values, strict=True
        ):
            hidden = layer.forward(hidden, ropes[layer.rope_key], key_cache, value_cache, meta)
        return self.norm.forward(hidden)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype, soft-capped as HF does (divide, tanh, multiply)."""
        logits = self.lm_head.forward(hidden)
        cap = self.shape.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Give every parameter its HF-named checkpoint tensor in self.dtype, fusing q/k/v and
        gate/up, norms as 1 + w in float32; fail loudly on anything missing. Reads each
        checkpoint tensor once."""
        loader = WeightLoader(self, weights, self.dtype)

        def put_norm(ours: str) -> None:
            target = self.get_parameter(ours)
            # w rounded to the serving dtype, then 1 + w in float32: HF's 1.0 + weight.float().
            weight = fuse(ours, [loader.read(ours)], target.shape, self.dtype)
            loader.assign(ours, 1.0 + weight.float())

        loader.put_embeddings(self.shape.tie_word_embeddings)
        put_norm("norm.weight")
        for i in range(self.shape.num_layers):
            prefix = f"layers.{i}."
            loader.put_linears(prefix)
            norms = list(LAYER_NORMS)
            if self.shape.qk_norm:
                norms += ["self_attn.q_norm", "self_attn.k_norm"]
            for norm in norms:
                put_norm(f"{prefix}{norm}.weight")
        loader.check_complete()


def _rope_keys(config) -> list[str]:
    """Per layer, the key of its RoPE table: its layer type where rope_parameters is keyed by
    layer type (Gemma 3 in transformers 5), else one table ("all") for every layer."""
    params = getattr(config, "rope_parameters", None) or {}
    layer_types = list(getattr(config, "layer_types", None) or [])[: config.num_hidden_layers]
    if layer_types and all(isinstance(params.get(kind), dict) for kind in layer_types):
        return layer_types
    return ["all"] * config.num_hidden_layers


def _rotary_table(config, key: str, head_dim: int, max_positions: int, dtype) -> RotaryEmbedding:
    """The cos/sin tables of one RoPE parameter set, built as transformers builds them."""
    if key == "all":
        params = getattr(config, "rope_parameters", None) or {}
        if params.get("rope_type", "default") in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {params['rope_type']!r}")
        return RotaryEmbedding(config, head_dim, max_positions, dtype)
    return _LayerTypeRotary(config, key, head_dim, max_positions, dtype)


class _LayerTypeRotary(RotaryEmbedding):
    """RotaryEmbedding's tables for the RoPE parameters of one layer type
    (config.rope_parameters[layer_type]), as HF's Gemma3RotaryEmbedding computes them."""

    def __init__(self, config, layer_type: str, head_dim: int, max_positions: int, dtype) -> None:
        nn.Module.__init__(self)
        params = config.rope_parameters[layer_type]
        rope_type = params.get("rope_type", "default")
        if rope_type in UNSUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported RoPE scaling type {rope_type!r} ({layer_type})")
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
            inv_freq, scaling = 1.0 / (params["rope_theta"] ** exponents), 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", layer_type=layer_type)
        freqs = torch.arange(max_positions, dtype=torch.float)[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", (emb.cos() * float(scaling)).to(dtype), persistent=False)
        self.register_buffer("sin", (emb.sin() * float(scaling)).to(dtype), persistent=False)
