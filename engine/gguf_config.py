"""Hugging Face configs for the GGUF architectures transformers reads incompletely or not at all.

transformers builds a config from GGUF metadata for llama, qwen2 and qwen3 (engine/
gguf_checkpoint.py uses it there). For gemma2 and gemma3 it drops the soft-caps, the RoPE
scaling and the local RoPE base; for phi3 the sliding window; granite it refuses. So these four
are built here from the keys llama.cpp's converter writes, read as llama.cpp reads them
(src/models/<arch>.cpp), since a GGUF means what llama.cpp makes of it:

- gemma2 / gemma3: the attention scale is 1/sqrt(head_dim), or 1/sqrt(hidden / heads) for the
  27B models (told apart by their layer count, 46 and 62), as gemma_pytorch sets
  query_pre_attn_scalar; sliding layers follow `attention.sliding_window_pattern` (an array of
  flags, or a period) or the family's period (2: every other layer from the first; 6: five
  sliding, then one full).
- gemma3: the full layers' RoPE base and scaling from `rope.freq_base` and `rope.scaling.*`,
  the sliding layers' base from `rope.freq_base_swa` (10,000 when absent: HF's default).
- phi3: llama.cpp ignores Phi's sliding window (a known gap it warns about); the file states
  the window the model was trained with, and Hugging Face applies it, so it is kept here. A
  file with longrope factors (`rope_factors_long`) is refused, as a longrope checkpoint is.
- granite: the embedding, attention, residual and logit multipliers.
"""

from __future__ import annotations

from engine.gguf_header import GGUFHeader

# llama.cpp's sliding-window period per family (load_swa_pattern's default).
_SWA_PERIOD = {"gemma2": 2, "gemma3": 6}
# Layer counts llama.cpp reads as the 27B models, whose attention scale uses hidden / heads.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
LONGROPE_TENSORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def builds_config(header: GGUFHeader) -> bool:
    """Whether this module makes the file's config (else transformers does)."""
    return header.architecture in _BUILDERS or _is_mixtral(header)


def hf_config(header: GGUFHeader):
    """The Hugging Face config of a GGUF file `builds_config` accepts."""
    if _is_mixtral(header):
        return _mixtral(header)
    return _BUILDERS[header.architecture](header)


def _is_mixtral(header: GGUFHeader) -> bool:
    """Mixtral's files are llama files with experts."""
    return header.architecture == "llama" and bool(header.arch_value("expert_count"))


def _common(header: GGUFHeader) -> dict:
    heads = int(header.arch_value("attention.head_count"))
    hidden = int(header.arch_value("embedding_length"))
    names = {info.name: info for info in header.tensors}
    return {
        "vocab_size": names["token_embd.weight"].shape[0],
        "hidden_size": hidden,
        "intermediate_size": int(header.arch_value("feed_forward_length")),
        "num_hidden_layers": int(header.arch_value("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(header.arch_value("attention.head_count_kv", heads)),
        "head_dim": int(header.arch_value("attention.key_length", hidden // heads)),
        "rms_norm_eps": float(header.arch_value("attention.layer_norm_rms_epsilon")),
        "max_position_embeddings": int(header.arch_value("context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        **_special_tokens(header),
    }


def _special_tokens(header: GGUFHeader) -> dict:
    """bos / eos / pad ids; eos lists the end-of-turn and end-of-message ids the file names
    too (`tokenizer.ggml.eot_token_id`, `eom_token_id`), which llama.cpp also stops at."""
    meta = header.metadata
    eos = [meta.get(f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    eos = list(dict.fromkeys(int(i) for i in eos if i is not None))
    out = {"eos_token_id": eos[0] if len(eos) == 1 else (eos or None)}
    for key in ("bos", "padding"):
        value = meta.get(f"tokenizer.ggml.{key}_token_id")
        if value is not None:
            out["pad_token_id" if key == "padding" else "bos_token_id"] = int(value)
    return out


def _layer_types(header: GGUFHeader, layers: int) -> list[str]:
    """Which layers slide, as llama.cpp's load_swa_pattern decides (dense_first=False)."""
    pattern = header.metadata.get(f"{header.architecture}.attention.sliding_window_pattern")
    if isinstance(pattern, list):
        flags = [bool(f) for f in pattern]
    else:
        period = int(pattern) if pattern is not None else _SWA_PERIOD[header.architecture]
        flags = [period == 0 or i % period < period - 1 for i in range(layers)]
    return ["sliding_attention" if f else "full_attention" for f in flags]


def _gemma_common(header: GGUFHeader) -> dict:
    common = _common(header)
    layers = common["num_hidden_layers"]
    if layers == _GEMMA_27B_LAYERS[header.architecture]:
        scalar = common["hidden_size"] // common["num_attention_heads"]
    else:
        scalar = common["head_dim"]
    return {
        **common,
        "query_pre_attn_scalar": scalar,
        "layer_types": _layer_types(header, layers),
        "final_logit_softcapping": header.arch_value("final_logit_softcapping"),
    }


def _gemma2(header: GGUFHeader):
    from transformers import Gemma2Config

    return Gemma2Config(
        **_gemma_common(header),
        sliding_window=int(header.arch_value("attention.sliding_window", 4096)),
        attn_logit_softcapping=header.arch_value("attn_logit_softcapping"),
        rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
    )


def _gemma3(header: GGUFHeader):
    from transformers import Gemma3TextConfig

    window = header.arch_value("attention.sliding_window")
    full = {"rope_type": "default", "rope_theta": float(header.arch_value("rope.freq_base"))}
    scaling = header.arch_value("rope.scaling.type")
    if scaling not in (None, "none"):
        full.update(rope_type=scaling, factor=float(header.arch_value("rope.scaling.factor")))
    local = float(header.arch_value("rope.freq_base_swa", 10000.0))
    config = _gemma_common(header)
    if not window:  # no window: every layer is full
        config["layer_types"] = ["full_attention"] * config["num_hidden_layers"]
    return Gemma3TextConfig(
        **config,
        sliding_window=int(window) if window else None,
        rope_parameters={
            "full_attention": full,
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        },
    )


def _phi3(header: GGUFHeader):
    from transformers import Phi3Config

    common = _common(header)
    rotary = int(header.arch_value("rope.dimension_count", common["head_dim"]))
    names = {info.name for info in header.tensors}
    rope: dict = {"rope_type": "default", "rope_theta": float(header.arch_value("rope.freq_base"))}
    if any(name in names for name in LONGROPE_TENSORS):
        rope["rope_type"] = "longrope"  # refused by check_supported, naming it
    if rotary != common["head_dim"]:
        rope["partial_rotary_factor"] = rotary / common["head_dim"]  # refused, naming it
    window = header.arch_value("attention.sliding_window")
    original = header.arch_value("rope.scaling.original_context_length")
    return Phi3Config(
        **common,
        rope_parameters=rope,
        sliding_window=int(window) if window else None,
        original_max_position_embeddings=int(original or common["max_position_embeddings"]),
    )


def _granite(header: GGUFHeader):
    from transformers import GraniteConfig

    common = _common(header)
    common.pop("head_dim")  # granite's head_dim is hidden / heads (its converter drops it)
    return GraniteConfig(
        **common,
        rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
        embedding_multiplier=float(header.arch_value("embedding_scale", 1.0)),
        attention_multiplier=float(header.arch_value("attention.scale", 1.0)),
        residual_multiplier=float(header.arch_value("residual_scale", 1.0)),
        logits_scaling=float(header.arch_value("logit_scale", 1.0)),
    )


def _qwen3moe(header: GGUFHeader):
    """Every layer a mixture of experts (llama.cpp's qwen3moe has no dense layers), the top-k
    weights renormalized (its build_moe_ffn's norm_w)."""
    from transformers import Qwen3MoeConfig

    common = _common(header)
    expert_size = int(header.arch_value("expert_feed_forward_length"))
    return Qwen3MoeConfig(
        **{
            **common,
            "intermediate_size": int(header.arch_value("feed_forward_length", 0)) or expert_size,
        },
        rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
        num_experts=int(header.arch_value("expert_count")),
        num_experts_per_tok=int(header.arch_value("expert_used_count")),
        moe_intermediate_size=expert_size,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    )


def _mixtral(header: GGUFHeader):
    """A llama file with experts: feed_forward_length is the experts' size (Mixtral has no
    dense MLP); no sliding window (llama.cpp applies none to these files)."""
    from transformers import MixtralConfig

    return MixtralConfig(
        **_common(header),
        rope_theta=float(header.arch_value("rope.freq_base", 10000.0)),
        num_local_experts=int(header.arch_value("expert_count")),
        num_experts_per_tok=int(header.arch_value("expert_used_count")),
        sliding_window=None,
    )


_BUILDERS = {
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "phi3": _phi3,
    "granite": _granite,
    "qwen3moe": _qwen3moe,
}
