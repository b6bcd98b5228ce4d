"""EOS ids come from config.json, the tokenizer and generation_config.json (as vLLM reads
them): a tiny random-weight Llama whose generation_config.json names one more EOS id stops
on it."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

from engine.core import _eos_token_ids
from engine.llm import LLM
from engine.loader import load_checkpoint
from scheduler.sampling_params import SamplingParams

VOCAB = 64
EOS = 1  # config.json's and the tokenizer's
PROMPT = [5, 6, 7, 8]
MAX_TOKENS = 8


def _save_model(path: Path) -> None:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        eos_token_id=EOS,
        bos_token_id=0,
        pad_token_id=0,
    )
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(0.3 * torch.randn(param.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    backend = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    backend.pre_tokenizer = WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="t0", bos_token="t0", eos_token=f"t{EOS}"
    ).save_pretrained(path)


def _write_generation_config(path: Path, eos_token_id: int | list[int]) -> None:
    (path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": eos_token_id})
    )


def _greedy(path: Path) -> tuple[list[int], str | None]:
    llm = LLM(model=str(path), dtype="float32", kv_cache_bytes=1 << 20)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    (output,) = llm.generate([PROMPT], params)
    return output.token_ids, output.finish_reason


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    _save_model(tmp_path)
    return tmp_path


def test_generation_config_adds_eos_ids(model_dir: Path) -> None:
    _write_generation_config(model_dir, [EOS, 42])
    checkpoint = load_checkpoint(str(model_dir))
    assert checkpoint.generation_config is not None
    assert checkpoint.generation_config.eos_token_id == [EOS, 42]
    ids = _eos_token_ids(checkpoint.config, checkpoint.tokenizer, checkpoint.generation_config)
    assert ids == frozenset({EOS, 42})


def test_without_generation_config(model_dir: Path) -> None:
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    checkpoint = load_checkpoint(str(model_dir))
    assert checkpoint.generation_config is None
    assert _eos_token_ids(checkpoint.config, checkpoint.tokenizer) == frozenset({EOS})
    assert _eos_token_ids(checkpoint.config, checkpoint.tokenizer, None) == frozenset({EOS})


def test_unreadable_generation_config_is_skipped(model_dir: Path, caplog) -> None:
    (model_dir / "generation_config.json").write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="engine.loader"):
        checkpoint = load_checkpoint(str(model_dir))
    assert checkpoint.generation_config is None
    assert "generation_config.json" in caplog.text


def test_the_engine_stops_on_an_eos_id_only_generation_config_names(model_dir: Path) -> None:
    (model_dir / "generation_config.json").unlink(missing_ok=True)
    tokens, reason = _greedy(model_dir)
    assert len(tokens) == MAX_TOKENS and reason == "length" and EOS not in tokens
    # The third greedy token (its first occurrence) becomes an EOS id.
    extra = tokens[2]
    stop_at = tokens.index(extra)
    _write_generation_config(model_dir, [EOS, extra])
    stopped, reason = _greedy(model_dir)
    assert stopped == tokens[: stop_at + 1] and reason == "stop"
