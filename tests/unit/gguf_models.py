"""Tiny random GGUF files written the way llama.cpp writes them, and their float oracle.

write_tiny_gguf() draws a random Hugging Face model (tiny_models' spread), stores each linear
weight in the block format the test names — through gguf-py's quantize where it has one
(Q4_0 ... Q8_0), else as random blocks in the ggml layout with sane fp16 scales (K-quants) —
with llama.cpp's q/k row interleave for the llama architecture (convert_hf_to_gguf's
LlamaModel.permute), and returns the HF model holding exactly what the file's blocks
dequantize to (gguf-py's dequantize, rows un-interleaved as transformers' reverse_permute
does): the oracle our runner must match.

The tokenizer keys are the embedded SmolLM2 GGUF's, cut to its first VOCAB tokens (17 special
tokens, the 256 byte tokens, the first merges) and the merges among them: the same BPE
tokenizer and chat template, small enough that transformers builds it in a second.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path

import numpy as np
import torch
from gguf import (
    GGML_QUANT_SIZES,
    MODEL_ARCH,
    GGMLQuantizationType,
    GGUFReader,
    GGUFWriter,
    RopeScalingType,
    get_tensor_name_map,
    quants,
)
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.loader import default_model_path

VOCAB = 512
EOS = 2  # <|im_end|>
T = GGMLQuantizationType
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Offsets of the fp16 scale fields in one K-quant block (ggml-common.h).
_K_SCALE_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
# Architectures whose converter (LlamaModel and its subclasses) interleaves q/k rows.
PERMUTED = ("llama", "granite")
# Architectures whose converter stores Gemma's norm weights as 1 + w.
NORM_SHIFTED = ("gemma2", "gemma3")
# With int8 inputs (gguf_activations "int8"): their rounding (1/254 of a block's largest input)
# is an error of bf16's order added to a model's; measured on a 2-core AMD EPYC Zen 4 (bf16), at
# most 2.0x HF bf16's own error.
INT8_SLACK = 3.0


def tiny_config(arch: str, tied: bool):
    return _CONFIGS[arch](
        vocab_size=VOCAB,
        hidden_size=256,  # K-quant rows hold multiples of 256 weights
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=tied,
        bos_token_id=1,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )


def gguf_name(hf: str, arch: str, layers: int) -> str:
    """The GGUF name llama.cpp's converter gives an HF tensor: gguf-py's TensorNameMap for the
    architecture, the table convert_hf_to_gguf maps names with."""
    module, _, leaf = hf.rpartition(".")
    name = get_tensor_name_map(MODEL_ARCH[arch.upper()], layers).get_name(module)
    assert name is not None, f"{arch}: no GGUF name for {hf}"
    return f"{name}.{leaf}"


def write_tiny_gguf(path: Path, arch: str, formats: dict[str, T], tied: bool, config=None):
    """A GGUF at path; formats: GGUF tensor role ("attn_q", "token_embd", ...) or one tensor's
    name ("blk.1.ffn_down_exps") -> type for weights of 2 or more dimensions (default F32); config: the HF config (default: tiny_config's for llama, qwen2
    and qwen3). Returns the float32 HF oracle model."""
    config = tiny_config(arch, tied) if config is None else config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(3)
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, config)
    _write_family_metadata(writer, config, arch)
    oracle = {}
    for hf, param in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        norm = hf.endswith("norm.weight")
        shift = np.float32(1.0 if norm and arch in NORM_SHIFTED else 0.0)
        center = 1.0 if norm and not shift else 0.0  # Gemma scales by 1 + w: w near 0
        weight = (center + 0.15 * torch.randn(param.shape, generator=gen)).numpy()
        values = []
        for piece, part in _pieces(hf, weight):
            name = gguf_name(piece, arch, config.num_hidden_layers)
            heads = _permute_heads(arch, name, config)
            stored = part + shift  # the converter's modify_tensors: Gemma's norms as 1 + w
            stored = stored if heads is None else _permute(stored, heads)
            role = formats.get(name.split(".")[-2], T.F32)  # a whole name ("blk.1.ffn_up") first
            kind = formats.get(name.removesuffix(".weight"), role) if part.ndim >= 2 else T.F32
            data, stored_values = _encode(stored, kind, rng)
            writer.add_tensor(name, data, raw_dtype=kind)
            values.append(
                stored_values if heads is None else _reverse_permute(stored_values, heads)
            )
        joined = values[0] if len(values) == 1 else np.concatenate(values, axis=1)
        oracle[hf] = torch.from_numpy(joined - shift)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if tied:
        oracle["lm_head.weight"] = oracle["model.embed_tokens.weight"]
    model.load_state_dict(oracle)
    return model


def _write_metadata(writer: GGUFWriter, config) -> None:
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(_rope(config)["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    writer.add_rope_dimension_count(head_dim)
    if config.model_type != "granite":  # GraniteModel's converter drops head_dim
        writer.add_key_length(head_dim)  # as convert_hf_to_gguf writes head_dim
        writer.add_value_length(head_dim)
    writer.add_vocab_size(config.vocab_size)
    tokens, token_types, merges, chat_template = smollm2_tokenizer_keys()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS)
    writer.add_unk_token_id(0)
    writer.add_pad_token_id(EOS)
    writer.add_chat_template(chat_template)


def _pieces(hf: str, weight: np.ndarray) -> list[tuple[str, np.ndarray]]:
    """The tensors the converter writes for one HF tensor: transformers 5's fused experts
    [E, 2I, H] split into gate and up ([E, I, H] each, names TensorNameMap maps to
    ffn_gate_exps / ffn_up_exps), its down_proj as ffn_down_exps; anything else as it is."""
    if hf.endswith("mlp.experts.gate_up_proj"):
        half = weight.shape[1] // 2
        base = hf.removesuffix("gate_up_proj")
        return [
            (f"{base}gate_proj.weight", weight[:, :half]),
            (f"{base}up_proj.weight", weight[:, half:]),
        ]
    if hf.endswith("mlp.experts.down_proj"):
        return [(f"{hf}.weight", weight)]
    return [(hf, weight)]


def _rope(config) -> dict:
    """The full-attention layers' RoPE parameters (Gemma 3 keeps one set per layer type)."""
    params = config.rope_parameters
    return params.get("full_attention", params)


def _write_family_metadata(writer: GGUFWriter, config, arch: str) -> None:
    """The keys each family's converter class adds (convert_hf_to_gguf's set_gguf_parameters)."""
    if arch in ("gemma2", "gemma3", "phi3") and getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
    if arch == "gemma3":
        full = _rope(config)
        if full.get("rope_type", "default") != "default":
            writer.add_rope_scaling_type(RopeScalingType(full["rope_type"]))
            writer.add_rope_scaling_factor(full["factor"])
        writer.add_rope_freq_base_swa(config.rope_parameters["sliding_attention"]["rope_theta"])
    if arch == "phi3":
        writer.add_rope_scaling_orig_ctx_len(config.original_max_position_embeddings)
    if getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None):
        experts = getattr(config, "num_local_experts", None) or config.num_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config.num_experts_per_tok)
        if arch == "qwen3moe":
            writer.add_expert_feed_forward_length(config.moe_intermediate_size)
    if arch == "granite":
        writer.add_attention_scale(config.attention_multiplier)
        writer.add_embedding_scale(config.embedding_multiplier)
        writer.add_residual_scale(config.residual_multiplier)
        writer.add_logit_scale(config.logits_scaling)


@cache
def smollm2_tokenizer_keys() -> tuple[list[str], list[int], list[str], str]:
    fields = GGUFReader(str(default_model_path())).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    token_types = fields["tokenizer.ggml.token_type"].contents()[:VOCAB]
    vocab = set(tokens)

    def kept(merge: str) -> bool:
        left, right = merge.split(" ")
        return left in vocab and right in vocab and left + right in vocab

    merges = [m for m in fields["tokenizer.ggml.merges"].contents() if kept(m)]
    return tokens, token_types, merges, fields["tokenizer.chat_template"].contents()


def _permute_heads(arch: str, name: str, config) -> int | None:
    if arch not in PERMUTED:
        return None
    if ".attn_q." in name:
        return config.num_attention_heads
    if ".attn_k." in name:
        return config.num_key_value_heads
    return None


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf LlamaModel.permute (weights and biases)."""
    rest = w.shape[1:]
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *rest).swapaxes(1, 2).reshape(w.shape)


def _reverse_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' LlamaTensorProcessor._reverse_permute_weights."""
    rest = w.shape[1:]
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *rest).swapaxes(2, 1).reshape(w.shape)


def _encode(weight: np.ndarray, kind: T, rng) -> tuple[np.ndarray, np.ndarray]:
    """(the bytes or floats to store, the float32 values they hold); stacked experts
    [E, rows, cols] row by row, as 2-D."""
    if weight.ndim == 3:
        data, values = _encode(
            np.ascontiguousarray(weight).reshape(-1, weight.shape[-1]), kind, rng
        )
        return data.reshape(*weight.shape[:2], -1), values.reshape(weight.shape)
    if kind == T.F32:
        return weight.astype(np.float32), weight.astype(np.float32)
    if kind == T.F16:
        half = weight.astype(np.float16)
        return half, half.astype(np.float32)
    if kind in QUANTIZABLE:
        blocks = quants.quantize(weight.astype(np.float32), kind)
    else:
        blocks = _random_k_blocks(weight.shape, kind, rng)
    return blocks, quants.dequantize(blocks, kind).astype(np.float32)


def _random_k_blocks(shape: tuple[int, ...], kind: T, rng) -> np.ndarray:
    """Random K-quant blocks whose fp16 super-block scales are small positive numbers, so the
    weights stay near tiny_models' spread."""
    block_weights, block_bytes = GGML_QUANT_SIZES[kind]
    rows, cols = shape
    blocks = rng.integers(0, 256, size=(rows, cols // block_weights, block_bytes), dtype=np.uint8)
    scale = 4e-4 if kind == T.Q6_K else 2.5e-3
    for offset in _K_SCALE_FIELDS[kind]:
        values = (scale * rng.uniform(0.5, 1.0, size=blocks.shape[:2])).astype(np.float16)
        blocks[..., offset : offset + 2] = values.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(rows, -1)
