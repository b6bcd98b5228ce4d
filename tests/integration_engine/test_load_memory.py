"""Loading holds one copy of the weights: peak resident memory while a model loads stays within
1.3x the bytes of the tensors it then serves.

A random-weight Llama of ~100 MB of bf16 weights is built into tmp_path and loaded through the
real loader and model runner in a fresh interpreter (engine/load_memory.py), which reads the
resident high-water mark over its baseline (torch, the kernels and transformers' config and
tokenizer code imported). Loading used to build the model in float32, cast it, and keep the
whole checkpoint and a second tied head meanwhile: 4.5x this model's bf16 weights, 1.8x what it
served. Only memory is asserted, never time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from engine.bench_models import RandomLlamaSpec, build_random_llama

LIMIT = 1.3
# 50M parameters (25M of them the tied 49,152 x 512 embedding): 100 MB in bf16.
SPEC = RandomLlamaSpec(
    hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8, num_kv_heads=4
)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_random_llama(SPEC, tmp_path_factory.mktemp("load-memory") / "llama")


def _measure(model: Path, dtype: str) -> dict:
    result = subprocess.run(
        [sys.executable, "-m", "engine.load_memory", "--model", str(model), "--dtype", dtype],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_load_peak_within_bound(model_dir: Path, dtype: str) -> None:
    figures = _measure(model_dir, dtype)
    assert figures["num_params"] == SPEC.num_params
    bytes_per_param = 2 if dtype == "bfloat16" else 4
    assert figures["weight_bytes"] == SPEC.num_params * bytes_per_param
    # Every tensor the model keeps is counted in served_bytes; the tied head adds none.
    assert figures["served_bytes"] >= figures["weight_bytes"]
    assert figures["load_peak_bytes"] <= LIMIT * figures["served_bytes"], figures
