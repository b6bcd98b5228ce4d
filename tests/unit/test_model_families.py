"""Tiny random-weight models of each supported family (tests/unit/tiny_models.py): saved by
transformers as safetensors, loaded through our loader, greedy output equal to Hugging Face
`generate` token for token, where HF's own greedy path has a clear margin at every step.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import (
    COMMON,
    EOS,
    MAX_NEW_TOKENS,
    assert_greedy_equals_oracle,
    assert_stack_equals_layer_loop,
    prompts,
    save_random_model,
)
from tiny_models import hf_greedy as _hf_greedy
from transformers import (
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    Phi3Config,
    Qwen2Config,
    Qwen3Config,
)

from engine.llm import LLM
from scheduler.sampling_params import SamplingParams

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


def _build_model(family: str, path: Path):
    return save_random_model(FAMILIES[family](), path)


def _prompts() -> list[list[int]]:
    return prompts()


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "plain-torch"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_model_greedy_equals_hugging_face(
    family: str, cpu_kernels: bool, tmp_path: Path
) -> None:
    model = _build_model(family, tmp_path)
    llm, outputs, expected = assert_greedy_equals_oracle(tmp_path, model, family, cpu_kernels)
    for output, tokens in zip(outputs, expected, strict=True):
        assert output.finish_reason == ("stop" if tokens[-1] == EOS else "length")
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks == llm.engine.kv_cache_info.num_usable_blocks


def test_qwen3_decode_stack_equals_its_layer_loop(tmp_path: Path) -> None:
    """bf16 with the kernels: Qwen3's q/k norms run inside the native decode stack on the same
    kernel as in the layer loop, so the same greedy and seeded sampled requests give the same
    tokens and the same logprobs, bit for bit, with the stack and with it detached."""
    _build_model("qwen3", tmp_path)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", block_size=4, kv_cache_bytes=1 << 20)
    assert_stack_equals_layer_loop(llm, _prompts()[:3], lambda runner: None)


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
