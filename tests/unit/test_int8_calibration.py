"""The int8 calibration on the real embedded model: a child process prefills the bundled text
and the maxima it records cover exactly the layers --quantization int8 swaps, one value per
input channel; a second start reads the cache (no child); a failed child is a clear error;
and the smoothing it feeds keeps int8 within 1 % of bf16's perplexity on held-out text."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from engine import int8_calibration
from engine.int8_calibration import cache_path, input_maxima
from engine.kernels import load_cpu_kernels
from engine.llm import LLM
from engine.loader import ModelLoadError, hf_checkpoint_dir
from engine.models.int8_linear import Int8Linear
from engine.perplexity import mean_logprob, text_token_ids

needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None,
    reason="int8 serves bf16 activations on the native kernels (AVX512-BF16)",
)


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return hf_checkpoint_dir("default")  # the float conversion, in the default cache


@pytest.fixture(scope="module")
def own_cache(model_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    """One calibration cache for the module (the child runs once, the later tests read it),
    set after model_dir, whose float conversion stays in the default cache."""
    path = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("METERSERVE_CACHE_DIR", str(path))
        yield path


def test_calibration_covers_every_quantized_layer_and_is_cached(
    model_dir: Path, own_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    maxima = input_maxima(model_dir)
    assert cache_path(model_dir).is_file()
    assert cache_path(model_dir).is_relative_to(own_cache)
    layers = 30  # SmolLM2-135M
    kinds = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
    assert sorted(maxima) == sorted(f"layers.{i}.{k}" for i in range(layers) for k in kinds)
    assert maxima["layers.0.self_attn.qkv_proj"].shape == (576,)
    assert maxima["layers.0.mlp.down_proj"].shape == (1536,)
    for values in maxima.values():
        assert values.dtype == torch.float32 and bool(torch.isfinite(values).all())
        assert bool((values > 0).all())
    # Outlier channels are what the smoothing is for: some channel far above the median.
    down = maxima["layers.10.mlp.down_proj"]
    assert down.max() > 10 * down.median()

    def no_child(*args) -> None:
        raise AssertionError("a cached calibration ran the child again")

    monkeypatch.setattr(int8_calibration, "run_child", no_child)
    again = input_maxima(model_dir)
    assert all(torch.equal(again[name], maxima[name]) for name in maxima)


def test_a_failed_calibration_says_so(tmp_path: Path, own_cache: Path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="int8 calibration of .*broken failed"):
        input_maxima(broken)


@needs_kernels
def test_int8_perplexity_within_one_percent_of_bf16(model_dir: Path, own_cache: Path) -> None:
    # The first 1,536 tokens of the bundled Declaration and Constitution (held out: the
    # calibration text is engine/data/int8_calibration.txt), 512-token windows.
    results = {}
    for quantization in ("none", "int8"):
        llm = LLM(model=str(model_dir), dtype="bfloat16", quantization=quantization)
        if quantization == "int8":
            layers = [m for m in llm.engine.runner.model.modules() if isinstance(m, Int8Linear)]
            assert len(layers) == 120 and all(m.inv_smooth is not None for m in layers)
        ids = text_token_ids(llm.tokenizer)[:1536]
        results[quantization] = math.exp(-mean_logprob(llm, ids, 512)[0])
        del llm
    assert results["int8"] / results["none"] < 1.01
