"""Loader errors: a missing or unsupported model gives ModelLoadError with one line of text."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import GPT2Config, LlamaConfig

from engine.llm import LLM
from engine.loader import ModelLoadError, load_checkpoint


def _assert_one_line(error: ModelLoadError, *fragments: str) -> None:
    message = str(error)
    assert message and "\n" not in message
    for fragment in fragments:
        assert fragment in message, message


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(missing))
    _assert_one_line(info.value, "does not exist", str(missing))


def test_missing_path_through_llm(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(tmp_path / "nope"), dtype="float32")
    _assert_one_line(info.value, "does not exist")


def test_unsupported_model_type(tmp_path: Path) -> None:
    GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        LLM(model=str(tmp_path), dtype="float32")
    _assert_one_line(info.value, "unsupported model type", "'gpt2'", "llama")


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(tmp_path))
    _assert_one_line(info.value, "no config.json")


def test_supported_config_without_weights(tmp_path: Path) -> None:
    LlamaConfig(
        vocab_size=32,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
    ).save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(tmp_path))
    _assert_one_line(info.value, "no *.safetensors")


def test_unreadable_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(tmp_path))
    _assert_one_line(info.value, "cannot read config")


def test_file_that_is_not_gguf(tmp_path: Path) -> None:
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 16)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(weights))
    _assert_one_line(info.value, "unsupported model path")
