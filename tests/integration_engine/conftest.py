"""Shared fixtures for engine-level tests on the real SmolLM2 model (see engine_equivalence.py).

The HF reference continuations are computed once per session and shared by every variant
(plain batch, preemption, prefix cache, chunked prefill, bfloat16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from engine_equivalence import MAX_NEW_TOKENS, Reference, build_prompts, hf_greedy_references
from tiny_draft import write_tiny_draft

from engine.loader import hf_checkpoint_dir


@pytest.fixture(scope="session")
def real_model_dir() -> Path:
    """The HF directory our loader converts the embedded GGUF into (converted if missing)."""
    return hf_checkpoint_dir("default")


@pytest.fixture(scope="session")
def real_tokenizer(real_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.fixture(scope="session")
def prompts(real_tokenizer) -> list[list[int]]:
    return build_prompts(real_tokenizer)


@pytest.fixture(scope="session")
def hf_references(real_model_dir: Path, real_tokenizer, prompts) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32).eval()
    eos = real_tokenizer.eos_token_id
    # One thread: it costs little on an idle machine and avoids OpenMP spin-waiting blowing
    # the fixture up (measured 5x on batch-1 decoding) when the cores are shared.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return hf_greedy_references(model, prompts, MAX_NEW_TOKENS, eos)
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def tiny_draft_dir(real_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with the real model's tokenizer and context: a draft model
    that shares the vocabulary and agrees with almost nothing."""
    return write_tiny_draft(real_model_dir, tmp_path_factory.mktemp("tiny-draft"))
