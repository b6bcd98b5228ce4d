"""A tiny random draft model beside the real one: a 2-layer Llama with its tokenizer."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch


def write_tiny_draft(
    real_model_dir: Path, out: Path, max_positions: int | None = None, extra_token: str = ""
) -> Path:
    """Random weights, the real model's vocabulary and context (or max_positions); with
    extra_token, a vocabulary that differs by that one added token."""
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    real = AutoConfig.from_pretrained(real_model_dir)
    config = LlamaConfig(
        vocab_size=real.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions or real.max_position_embeddings,
        tie_word_embeddings=True,
        bos_token_id=real.bos_token_id,
        eos_token_id=real.eos_token_id,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)
    for path in real_model_dir.iterdir():
        if path.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(path, out / path.name)
    if extra_token:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(out)
        tokenizer.add_tokens([extra_token])
        tokenizer.save_pretrained(out)
    return out
