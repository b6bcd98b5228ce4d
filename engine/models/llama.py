"""The Llama family (Llama 2/3, SmolLM2, TinyLlama, Mistral, Qwen2, Qwen3, Phi-3/4, Granite)
over the paged cache.

Family differences are flags read from the HF config:
- Qwen2: bias on q/k/v projections (`attention_bias`, implied by model_type qwen2);
- Qwen3: RMSNorm over each head of q and k before RoPE;
- Mistral, Phi-3, Qwen2/3 with `use_sliding_window`: sliding-window attention on the layers
  engine/sliding_windows.py names;
- Phi-3/Phi-4: q/k/v and gate/up stored fused in the checkpoint (loaded as they are);
- Granite: embedding, attention, residual and logits multipliers;
- Qwen3-MoE, Mixtral: a sparse mixture-of-experts MLP (engine/models/moe.py) on the layers
  moe_layer_indices names (Qwen3-MoE's other layers keep a dense MLP), Qwen3-MoE with
  Qwen3's q/k norm;
- tied or untied LM head (`tie_word_embeddings`).
Weights keep Hugging Face names except q/k/v and gate/up, which are fused at load time (or
arrive fused).

The model is built on the meta device (shapes only, no memory); load_weights gives every
parameter its tensor from the checkpoint, already in the serving dtype, one at a time, and a
tied LM head is the embedding's own tensor. So loading holds one copy of the weights, plus
the tensor being read.

Inside the model, submodules are run with `.forward(...)` rather than called: nn.Module's
__call__ dispatch (hooks, tracing checks) costs about 2 µs a call, and a step makes ~210 of
them, ≈ 0.4 ms of a 4.7 ms single-stream step. Nothing here registers hooks.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from engine.attention.metadata import AttentionMetadata
from engine.models.layer_ops import RotaryInputs, TorchLayerOps
from engine.models.layers import GatedMLP, RMSNorm, RotaryEmbedding
from engine.models.moe import ROUTER_NAMES, SparseMoE, moe_layer_indices
from engine.models.weight_loader import LINEAR_SOURCES, WeightLoader
from engine.sliding_windows import layer_windows


@dataclass(frozen=True, slots=True)
class LlamaShape:
    """The sizes and flags that define one model of the family."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    attention_bias: bool
    qk_norm: bool
    tie_word_embeddings: bool
    layer_windows: tuple[int | None, ...] = ()  # per layer: sliding window or None (full)
    # Granite's multipliers (1.0 / None elsewhere): embeddings * embedding_multiplier,
    # attention scale = attention_multiplier (None: head_dim ** -0.5), each layer's attention
    # and MLP outputs * residual_multiplier before the residual add, logits / logits_scaling.
    embedding_multiplier: float = 1.0
    attention_multiplier: float | None = None
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    # Mixture of experts (Qwen3-MoE, Mixtral; 0 / empty elsewhere): the layers whose MLP is a
    # SparseMoE of num_experts experts of moe_intermediate_size, num_experts_per_tok per token;
    # the others keep a dense MLP of intermediate_size. norm_topk_prob: renormalize the top-k
    # routing weights; round_routing_weights: cast them to the model's dtype before scaling
    # (Qwen3-MoE; Mixtral scales in float32), as transformers does.
    moe_layers: frozenset[int] = frozenset()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    round_routing_weights: bool = False

    @property
    def plain_llama(self) -> bool:
        """No window and no multiplier: the layer the native decode stack runs."""
        return (
            all(w is None for w in self.layer_windows)
            and self.embedding_multiplier == 1.0
            and self.attention_multiplier is None
            and self.residual_multiplier == 1.0
            and self.logits_scaling == 1.0
        )

    @classmethod
    def from_config(cls, config) -> LlamaShape:
        num_heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
        model_type = config.model_type
        return cls(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=config.rms_norm_eps,
            attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe"),
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            layer_windows=layer_windows(config),
            embedding_multiplier=float(getattr(config, "embedding_multiplier", 1.0)),
            attention_multiplier=getattr(config, "attention_multiplier", None),
            residual_multiplier=float(getattr(config, "residual_multiplier", 1.0)),
            logits_scaling=float(getattr(config, "logits_scaling", 1.0)),
            **_moe_fields(config),
        )


class Attention(nn.Module):
    def __init__(self, shape: LlamaShape, backend, ops, sliding_window: int | None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = (
            shape.num_heads,
            shape.num_kv_heads,
            shape.head_dim,
        )
        q_size, kv_size = shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim
        self.split_sizes = (q_size, kv_size, kv_size)
        self.qkv_proj = nn.Linear(
            shape.hidden_size, q_size + 2 * kv_size, bias=shape.attention_bias
        )
        self.o_proj = nn.Linear(q_size, shape.hidden_size, bias=False)
        self.q_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.k_norm = RMSNorm(shape.head_dim, shape.rms_norm_eps) if shape.qk_norm else None
        self.scale = (
            shape.head_dim**-0.5
            if shape.attention_multiplier is None
            else float(shape.attention_multiplier)
        )
        self.sliding_window = sliding_window
        self.backend = backend
        self.ops = ops

    def forward(self, hidden, rope: RotaryInputs, key_cache, value_cache, meta: AttentionMetadata):
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj.forward(hidden)
        q_size, kv_size, _ = self.split_sizes
        if self.q_norm is not None:
            # Qwen3 normalizes each q and k head before RoPE, in place, so q and k stay
            # adjacent in qkv and rotate together below.
            eps = self.q_norm.eps
            self.ops.rms_norm_heads_(qkv, 0, self.q_norm.weight, self.num_heads, eps)
            self.ops.rms_norm_heads_(qkv, q_size, self.k_norm.weight, self.num_kv_heads, eps)
        # q and k are adjacent in qkv: rotate them as one [tokens, heads + kv_heads, dim].
        qk = self.ops.rotate_heads(qkv, rope, self.num_heads + self.num_kv_heads, self.head_dim)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.backend.forward(
            q, k, v, key_cache, value_cache, meta, self.scale, sliding_window=self.sliding_window
        )
        return self.o_proj.forward(out.reshape(num_tokens, -1))


class DecoderLayer(nn.Module):
    """Pre-norm decoder layer carrying the residual stream separately, so that the residual
    add and the next RMSNorm are one operation (ops.add_rms_norm)."""

    def __init__(self, shape: LlamaShape, backend, ops, index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        window = shape.layer_windows[index] if shape.layer_windows else None
        self.self_attn = Attention(shape, backend, ops, window)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        if index in shape.moe_layers:
            self.mlp = SparseMoE(shape, ops)
        else:
            self.mlp = GatedMLP(shape.hidden_size, shape.intermediate_size, ops)
        self.ops = ops
        self.eps = shape.rms_norm_eps
        self.residual_multiplier = shape.residual_multiplier

    def forward(self, hidden, residual, rope, key_cache, value_cache, meta):
        """(output of the previous layer, residual before it) -> the same for this layer.

        residual is None for the first layer: hidden is then the embedding output.
        """
        if residual is None:
            residual = hidden
            hidden = self.ops.rms_norm(hidden, self.input_layernorm.weight, self.eps)
        else:
            hidden, residual = self.ops.add_rms_norm(
                hidden, residual, self.input_layernorm.weight, self.eps
            )
        hidden = self.self_attn.forward(hidden, rope, key_cache, value_cache, meta)
        if self.residual_multiplier != 1.0:  # Granite: residual + output * multiplier
            hidden = hidden * self.residual_multiplier
        hidden, residual = self.ops.add_rms_norm(
            hidden, residual, self.post_attention_layernorm.weight, self.eps
        )
        hidden = self.mlp.forward(hidden)
        if self.residual_multiplier != 1.0:
            hidden = hidden * self.residual_multiplier
        return hidden, residual


class LlamaForCausalLM(nn.Module):
    """forward() returns final hidden states; compute_logits() runs the LM head on chosen rows.

    Parameters stay on the meta device until load_weights() (the RoPE tables are real)."""

    def __init__(self, config, backend, max_positions: int, dtype: torch.dtype, ops=None) -> None:
        super().__init__()
        self.shape = shape = LlamaShape.from_config(config)
        self.dtype = dtype
        self.ops = ops = ops or TorchLayerOps()
        with torch.device("meta"):
            # _weight skips the normal_() init, whose meta kernel would import ~150 MB of
            # torch._refs/sympy modules into the process; every other init op has a C++ one.
            size = (shape.vocab_size, shape.hidden_size)
            self.embed_tokens = nn.Embedding(*size, _weight=torch.empty(size))
            self.layers = nn.ModuleList(
                DecoderLayer(shape, backend, ops, i) for i in range(shape.num_layers)
            )
            self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
            self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(config, shape.head_dim, max_positions, dtype)
        # Set by the runner once the KV cache exists (engine/models/decode_stack.py): runs
        # small decode-only steps' layers in one native call, bit-identical to the loop below;
        # stack_experts_run, stack_expert_bytes: the experts it ran in the last forward and
        # their bytes, layer by layer (None: the loop ran).
        self.decode_stack = None
        self.stack_experts_run = None
        self.stack_expert_bytes = 0

    @torch.inference_mode()
    def forward(self, input_ids, positions, kv_cache, meta: AttentionMetadata) -> torch.Tensor:
        hidden, residual = self.embed_tokens.forward(input_ids), None
        if self.shape.embedding_multiplier != 1.0:  # Granite
            hidden = hidden * self.shape.embedding_multiplier
        stack = self.decode_stack
        if stack is not None and stack.takes(meta, hidden.shape[0], kv_cache):
            hidden, self.stack_experts_run, self.stack_expert_bytes = stack.run(
                hidden, positions, meta
            )
            return hidden
        self.stack_experts_run = None
        rope = self.ops.rotary_inputs(self.rotary, positions)
        for layer, key_cache, value_cache in zip(
            self.layers, kv_cache.keys, kv_cache.values, strict=True
        ):
            hidden, residual = layer.forward(hidden, residual, rope, key_cache, value_cache, meta)
        hidden, _ = self.ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)
        return hidden

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits in the model's dtype; the sampler widens them only when it must."""
        logits = self.lm_head.forward(hidden)
        if self.shape.logits_scaling != 1.0:  # Granite
            logits = logits / self.shape.logits_scaling
        return logits

    @property
    def num_experts_run(self) -> int:
        """Distinct (layer, expert) pairs the last forward ran (each read its expert's weights
        once); 0 for a dense model."""
        if self.stack_experts_run is not None:
            return self.stack_experts_run
        moe = (layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE))
        return sum(mlp.num_experts_run for mlp in moe)

    @property
    def expert_bytes_run(self) -> int:
        """Bytes of the experts the last forward ran, layer by layer (a GGUF's layers may
        store their experts in different formats: Q4_K_M files put half the downs in Q6_K)."""
        if self.stack_experts_run is not None:
            return self.stack_expert_bytes
        moe = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoE)]
        return sum(mlp.num_experts_run * mlp.bytes_per_expert for mlp in moe)

    def load_weights(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Give every parameter its HF-named checkpoint tensor in self.dtype, fusing q/k/v and
        gate/up; fail loudly on anything missing. Reads each checkpoint tensor once."""
        loader = WeightLoader(self, weights, self.dtype)
        loader.put_embeddings(self.shape.tie_word_embeddings)
        loader.put("norm.weight")
        for i in range(self.shape.num_layers):
            self._load_layer(f"layers.{i}.", loader)
        loader.check_complete()

    def _load_layer(self, prefix: str, loader: WeightLoader) -> None:
        mlp = self.get_submodule(f"{prefix}mlp")
        moe = isinstance(mlp, SparseMoE)
        loader.put_linears(prefix, skip=lambda ours: moe and ours.startswith("mlp."))
        if moe:
            names = (n for n in ROUTER_NAMES if loader.has(f"{prefix}{n}"))
            router = next(names, ROUTER_NAMES[0])
            loader.put(f"{prefix}mlp.gate.weight", (f"{prefix}{router}",))
            mlp.load(prefix, loader.read, loader.has, self.dtype, loader.blocks)
        if self.shape.attention_bias:
            sources = LINEAR_SOURCES["self_attn.qkv_proj"]
            loader.put(
                f"{prefix}self_attn.qkv_proj.bias", tuple(f"{prefix}{s}.bias" for s in sources)
            )
        norms = ["input_layernorm", "post_attention_layernorm"]
        if self.shape.qk_norm:
            norms += ["self_attn.q_norm", "self_attn.k_norm"]
        for norm in norms:
            loader.put(f"{prefix}{norm}.weight")


def _moe_fields(config) -> dict:
    """LlamaShape's mixture-of-experts fields from an HF config (none for a dense model)."""
    layers = moe_layer_indices(config)
    if not layers:
        return {}
    mixtral = config.model_type == "mixtral"
    return {
        "moe_layers": layers,
        "num_experts": config.num_local_experts if mixtral else config.num_experts,
        "num_experts_per_tok": config.num_experts_per_tok,
        # Mixtral's intermediate_size is its experts' (it has no dense MLP).
        "moe_intermediate_size": config.intermediate_size
        if mixtral
        else config.moe_intermediate_size,
        "norm_topk_prob": mixtral or bool(config.norm_topk_prob),
        "round_routing_weights": not mixtral,
    }
