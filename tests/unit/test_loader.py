"""Loader: a missing or unsupported model gives ModelLoadError with one line of text; the
weights the model serves are the checkpoint's tensors exactly (cast once to the serving dtype,
q/k/v and gate/up stacked), a tied LM head is the embedding's own tensor, and the checkpoint is
read one tensor at a time."""

from __future__ import annotations

import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GPT2Config, LlamaConfig

from engine.bench_models import RandomLlamaSpec, build_random_llama
from engine.config import EngineConfig
from engine.llm import LLM
from engine.loader import CheckpointWeights, ModelLoadError, load_checkpoint
from engine.model_runner import ModelRunner
from engine.models.packed_linear import PackedLinear


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


# -- weights: read one tensor at a time, kept exactly, a tied head sharing the embedding ------

TINY = RandomLlamaSpec(
    hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2
)


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory) -> dict[bool, Path]:
    """tie_word_embeddings -> a tiny random Llama checkpoint (bf16 safetensors)."""
    root = tmp_path_factory.mktemp("tiny-llama")
    return {
        tied: build_random_llama(replace(TINY, tie_word_embeddings=tied), root / f"tied-{tied}")
        for tied in (True, False)
    }


def _runner(model_dir: Path, dtype: str) -> ModelRunner:
    config = EngineConfig(model=str(model_dir), dtype=dtype, cpu_kernels=False)
    return ModelRunner(config, load_checkpoint(str(model_dir)), max_model_len=64)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("tied", [True, False])
def test_weights_are_the_files_tensors(tiny_dirs, tied: bool, dtype: str) -> None:
    model_dir = tiny_dirs[tied]
    runner = _runner(model_dir, dtype)
    model = runner.model
    assert not any(p.is_meta for p in model.parameters())
    file = load_file(str(model_dir / "model.safetensors"))
    target = runner.dtype

    def expect(ours: str, *theirs: str) -> None:
        module_name, _, leaf = ours.rpartition(".")
        served = _logical(model.get_submodule(module_name), leaf)
        want = torch.cat([file[name] for name in theirs]).to(target)
        assert served.dtype == target and torch.equal(served, want), ours

    layer = "model.layers.1."
    expect("embed_tokens.weight", "model.embed_tokens.weight")
    expect("norm.weight", "model.norm.weight")
    expect("layers.1.input_layernorm.weight", layer + "input_layernorm.weight")
    expect("layers.1.mlp.down_proj.weight", layer + "mlp.down_proj.weight")
    expect("layers.1.self_attn.o_proj.weight", layer + "self_attn.o_proj.weight")
    qkv = (layer + f"self_attn.{x}_proj.weight" for x in "qkv")
    expect("layers.1.self_attn.qkv_proj.weight", *qkv)
    gate_up = (layer + "mlp.gate_proj.weight", layer + "mlp.up_proj.weight")
    expect("layers.1.mlp.gate_up_proj.weight", *gate_up)
    head = "model.embed_tokens.weight" if tied else "lm_head.weight"
    expect("lm_head.weight", head)
    if tied and isinstance(model.lm_head, torch.nn.Linear):
        assert model.lm_head.weight is model.embed_tokens.weight  # one tensor, not a copy


def _logical(module: torch.nn.Module, leaf: str) -> torch.Tensor:
    """A weight as the model serves it: the parameter, or a PackedLinear's oneDNN layout
    turned back into a plain tensor (no kernels here, so no AMX layout)."""
    if isinstance(module, PackedLinear):
        return module.packed_weight.to_dense()
    return getattr(module, leaf)


def test_tied_head_counted_once(tiny_dirs) -> None:
    runner = _runner(tiny_dirs[True], "float32")
    assert runner.num_params == TINY.num_params


def test_weights_are_read_lazily(tiny_dirs) -> None:
    checkpoint = load_checkpoint(str(tiny_dirs[True]))
    assert isinstance(checkpoint.weights, CheckpointWeights)
    assert set(checkpoint.weights) == set(TINY.tensor_shapes())
    first = checkpoint.weights["model.norm.weight"]
    second = checkpoint.weights["model.norm.weight"]
    assert torch.equal(first, second) and first.data_ptr() != second.data_ptr()  # not cached


def test_missing_weight_is_named(tmp_path: Path, tiny_dirs) -> None:
    source = tiny_dirs[True]
    for item in source.iterdir():
        if item.name != "model.safetensors":
            shutil.copy(item, tmp_path / item.name)
    tensors = load_file(str(source / "model.safetensors"))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.mlp.up_proj.weight"):
        _runner(tmp_path, "float32")


def test_random_model_is_reproducible_and_reused(tmp_path: Path, tiny_dirs) -> None:
    again = build_random_llama(TINY, tmp_path / "again")
    file = (again / "model.safetensors").read_bytes()
    assert file == (tiny_dirs[True] / "model.safetensors").read_bytes()  # seeded: same bytes
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    assert build_random_llama(TINY, again) == again  # same spec: not rebuilt
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime
    build_random_llama(replace(TINY, seed=1), again)  # another spec: rebuilt
    assert (again / "model.safetensors").read_bytes() != file
