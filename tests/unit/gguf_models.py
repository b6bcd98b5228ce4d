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
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter, quants
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

from engine.loader import default_model_path

VOCAB = 512
EOS = 2  # <|im_end|>
T = GGMLQuantizationType
QUANTIZABLE = (T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0)
# Offsets of the fp16 scale fields in one K-quant block (ggml-common.h).
_K_SCALE_FIELDS = {T.Q4_K: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208,)}
_CONFIGS = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}
_LAYER = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


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


def gguf_name(hf: str) -> str:
    hf = hf.removeprefix("model.")
    names = {"embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight"}
    if hf in names:
        return names[hf]
    if hf == "lm_head.weight":
        return "output.weight"
    _, layer, rest = hf.split(".", 2)
    module, leaf = rest.rsplit(".", 1)
    return f"blk.{layer}.{_LAYER[module]}.{leaf}"


def write_tiny_gguf(path: Path, arch: str, formats: dict[str, T], tied: bool):
    """A GGUF at path; formats: GGUF tensor role ("attn_q", "token_embd", ...) -> type for
    2-D weights (default F32). Returns the float32 HF oracle model."""
    config = tiny_config(arch, tied)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    rng = np.random.default_rng(3)
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, config)
    oracle = {}
    for hf, param in model.state_dict().items():
        if tied and hf == "lm_head.weight":
            continue
        center = 1.0 if hf.endswith("norm.weight") else 0.0
        weight = (center + 0.15 * torch.randn(param.shape, generator=gen)).numpy()
        name = gguf_name(hf)
        heads = _permute_heads(arch, name, config)
        stored = weight if heads is None else _permute(weight, heads)
        kind = formats.get(name.split(".")[-2], T.F32) if weight.ndim == 2 else T.F32
        data, values = _encode(stored, kind, rng)
        writer.add_tensor(name, data, raw_dtype=kind)
        oracle[hf] = torch.from_numpy(values if heads is None else _reverse_permute(values, heads))
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
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_dimension_count(config.head_dim)
    writer.add_key_length(config.head_dim)  # as convert_hf_to_gguf writes head_dim
    writer.add_value_length(config.head_dim)
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
    if arch != "llama":
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
    """(the bytes or floats to store, the float32 values they hold)."""
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
