"""Tiny random-weight models of each supported family: saved by transformers as safetensors,
loaded through our loader, greedy output equal to Hugging Face `generate` token for token.

Weights are drawn with a wider spread than transformers' init (std 0.02 makes every logit
nearly equal, so greedy decoding would ride on rounding noise); the test also checks that
HF's greedy path has a clear margin at every step, so an equality failure means a real bug.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen3Config,
)

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

VOCAB = 211
EOS = 1
MAX_NEW_TOKENS = 12
PROMPT_LENGTHS = (3, 9, 17, 30)
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "eos_token_id": EOS,
    "bos_token_id": 0,
    "pad_token_id": 0,
}

FAMILIES = {
    "llama-tied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama-untied": lambda: LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama-rope-llama3": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),
    "llama-rope-linear": lambda: LlamaConfig(
        **COMMON, rope_parameters={"rope_type": "linear", "rope_theta": 500.0, "factor": 3.0}
    ),
    "llama-rope-yarn": lambda: LlamaConfig(
        **COMMON,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: MistralConfig(**COMMON, sliding_window=None),
    # A window of 8 under prompts of up to 30 tokens: every layer slides.
    "mistral-window": lambda: MistralConfig(**COMMON, sliding_window=8),
    # Qwen2 with use_sliding_window: full attention below max_window_layers, windows above.
    "qwen2-window": lambda: Qwen2Config(
        **COMMON, use_sliding_window=True, sliding_window=6, max_window_layers=1
    ),
    # Phi-3 stores q/k/v and gate/up fused; a window on every layer.
    "phi3": lambda: Phi3Config(**COMMON, sliding_window=8, tie_word_embeddings=False),
    "granite": lambda: GraniteConfig(
        **COMMON,
        embedding_multiplier=4.0,
        attention_multiplier=0.05,
        residual_multiplier=0.6,
        logits_scaling=2.5,
    ),
    "qwen2": lambda: Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen3": lambda: Qwen3Config(**COMMON, head_dim=16, tie_word_embeddings=True),
}


def _save_tokenizer(path: Path) -> None:
    """A word-level tokenizer whose ids are the vocabulary "t0".."t{VOCAB-1}"."""
    vocab = {f"t{i}": i for i in range(VOCAB)}
    backend = Tokenizer(WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", bos_token="t0", eos_token=f"t{EOS}"
    )
    tokenizer.save_pretrained(path)


def _build_model(family: str, path: Path):
    torch.manual_seed(0)
    config = FAMILIES[family]()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.15 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    _save_tokenizer(path)
    return model


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [(torch.randint(2, VOCAB, (n,), generator=gen)).tolist() for n in PROMPT_LENGTHS]


def _hf_greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    """HF's greedy continuation and the smallest top-1/top-2 logit margin along it."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    margins = [float(torch.topk(step[0], 2).values.diff().abs()) for step in out.logits]
    return out.sequences[0, len(prompt) :].tolist(), min(margins)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "plain-torch"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_model_greedy_equals_hugging_face(
    family: str, cpu_kernels: bool, tmp_path: Path
) -> None:
    model = _build_model(family, tmp_path)
    prompts = _prompts()
    expected = []
    for prompt in prompts:
        tokens, margin = _hf_greedy(model, prompt)
        assert margin > 1e-3, f"{family}: HF's greedy path has a near-tie; pick another seed"
        expected.append(tokens)
    # block_size 4 and a 16-token step budget: multi-block tables, the 30-token prompt is
    # prefilled in chunks while the others decode.
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=16,
        attention_backend="auto" if cpu_kernels else "batched",
        cpu_kernels=cpu_kernels,
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outputs] == expected
    for output, tokens in zip(outputs, expected, strict=True):
        assert output.finish_reason == ("stop" if tokens[-1] == EOS else "length")
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks == llm.engine.kv_cache_info.num_usable_blocks


def test_reference_backend_matches_too(tmp_path: Path) -> None:
    model = _build_model("qwen2", tmp_path)
    prompts = _prompts()
    expected = [_hf_greedy(model, prompt)[0] for prompt in prompts]
    llm = LLM(
        model=str(tmp_path),
        dtype="float32",
        block_size=8,
        kv_cache_bytes=1 << 20,
        attention_backend="reference",
    )
    outputs = llm.generate(prompts, SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0))
    assert [o.token_ids for o in outputs] == expected


def test_num_threads_applies_to_the_engine(tmp_path: Path) -> None:
    _build_model("llama-tied", tmp_path)
    before = torch.get_num_threads()
    try:
        llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_bytes=1 << 20, num_threads=1)
        assert torch.get_num_threads() == 1
        out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(out[0].token_ids) == 3
    finally:
        torch.set_num_threads(before)


def test_empty_prompt_is_rejected_not_replaced(tmp_path: Path) -> None:
    _build_model("llama-tied", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="float32", kv_cache_bytes=1 << 20)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=2))
