"""A GGUF model on the native kernels (bfloat16, kernels.gguf_linear over the stored blocks).

- the tiny random Llama / Qwen2 / Qwen3 files of tests/unit/gguf_models.py in bfloat16 are as
  close to their float32 oracle as Hugging Face's own bf16 model is;
- the meter's bytes per forward are the stored block bytes;
- loading the embedded SmolLM2 Q4_1 file keeps one copy of its blocks, and its resident peak
  stays within 1.2 x the file plus the tokenizer's own allowance.
Skipped where the kernels (or their gguf_linear) are not built.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from gguf_models import INT8_SLACK, write_tiny_gguf
from test_gguf_checkpoint import CASES
from tiny_models import chosen_logprobs, prompts

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm import LLM
from engine.loader import default_model_path, load_checkpoint
from engine.model_runner import ModelRunner
from engine.models.gguf_linear import GGUFLinear
from scheduler.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# Our bf16 error against the float32 oracle may be this many times HF bf16's own (different
# summation orders; activations rounded at other points). A wrong block format or an
# un-interleaved q row moves log-probabilities by whole nats, far beyond either.
BF16_SLACK = 2.0
# Resident memory of loading the embedded model beyond 1.2 x the file: the tokenizer (49152
# tokens, 48900 merges as Python and Rust objects) and the allocator's slack. Measured on a
# 2-core Xeon (no AMX): peak over the baseline = file + 25 MB.
LOAD_ALLOWANCE = 64 << 20


@pytest.fixture(scope="module")
def kernels():
    found = load_cpu_kernels()
    if found is None or not hasattr(found, "gguf_linear"):
        pytest.skip("needs the native kernels with gguf_linear")
    return found


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory, kernels) -> dict[str, tuple[Path, object]]:
    root = tmp_path_factory.mktemp("gguf-native")
    return {
        arch: (root / f"{arch}.gguf", write_tiny_gguf(root / f"{arch}.gguf", arch, f, tied))
        for arch, (f, tied) in CASES.items()
    }


@pytest.mark.parametrize("arch", sorted(CASES))
def test_bf16_logprobs_as_close_to_the_oracle_as_hf_bf16(gguf_files, arch: str) -> None:
    """Along our own greedy path, our log-probability of each chosen token is as close to the
    float32 oracle's as Hugging Face's own bf16 model's is (greedy sequences themselves flip at
    near-ties: HF bf16 leaves its float32 path here at logit gaps up to 0.9)."""
    path, oracle = gguf_files[arch]
    llm = LLM(model=str(path), dtype="bfloat16", block_size=4, kv_cache_bytes=1 << 20)
    runner = llm.engine.runner
    assert runner.num_gguf_matvec_layers == 4 * runner.shape.num_layers + 1
    # The native decode stack reads GGUF blocks too, and runs Qwen3's q/k norms; Qwen2's
    # biases are not in its layer.
    assert (runner.model.decode_stack is not None) == (arch != "qwen2")
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    hf_bf16 = copy.deepcopy(oracle).to(torch.bfloat16)
    for prompt, output in zip(prompts(), llm.generate(prompts(), greedy), strict=True):
        ours = torch.tensor([entry.logprob for entry in output.logprobs])
        want = chosen_logprobs(oracle, prompt, output.token_ids)
        hf_error = (chosen_logprobs(hf_bf16, prompt, output.token_ids) - want).abs().max()
        assert (ours - want).abs().max() <= BF16_SLACK * hf_error + 0.02, (arch, prompt)


def test_weight_bytes_are_the_stored_blocks(gguf_files, kernels) -> None:
    path, _ = gguf_files["qwen2"]
    checkpoint = load_checkpoint(str(path))
    config = EngineConfig(model=str(path), dtype="bfloat16", gguf_large_batch="blocks")
    runner = ModelRunner(config, checkpoint, 64)
    linears = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert all(m.kernels is kernels for m in linears)
    body = sum(m.bytes_read() for m in linears if m is not runner.model.lm_head)
    norms = sum(p.numel() * 2 for n, p in runner.model.named_parameters() if "norm" in n)
    bytes_read = runner.weight_bytes()
    assert bytes_read.body(1) == bytes_read.body(64) == body + norms
    assert bytes_read.head(1) == bytes_read.head(64) == runner.model.lm_head.bytes_read()
    # Qwen2: a Q6_K head of 512 rows x 256 (210 bytes per 256 weights).
    assert runner.model.lm_head.bytes_read() == 512 * 210
    # With a bf16 copy for large batches, those read it: 2 bytes a weight. On an AMX CPU the
    # blocks serve up to GGUF_WIDE_TILE_ROWS (64: the tiles), else up to 4.
    copied_config = EngineConfig(model=str(path), dtype="bfloat16", gguf_large_batch="bf16")
    copied = ModelRunner(copied_config, checkpoint, 64)
    head = copied.model.lm_head
    blocks_rows = kernels.GGUF_WIDE_TILE_ROWS if kernels.amx_available() else 4
    assert head.blocks_rows() == blocks_rows
    assert head.bytes_read(1) == head.bytes_read(blocks_rows) == 512 * 210
    assert head.bytes_read(blocks_rows + 1) == head.bytes_read(128) == 512 * 256 * 2
    copied_bytes = copied.weight_bytes()
    linears = [m for m in copied.model.modules() if isinstance(m, GGUFLinear) and m is not head]
    copies = sum(m.bytes_read(128) for m in linears)  # the bf16 copies (and Qwen2's qkv biases)
    assert copied_bytes.body(blocks_rows) == body + norms
    assert copied_bytes.body(blocks_rows + 1) == copied_bytes.body(128) == copies + norms
    assert copied_bytes.head(blocks_rows) == 512 * 210
    assert copied_bytes.head(blocks_rows + 1) == 512 * 256 * 2


def test_loading_the_embedded_model_keeps_one_copy(kernels) -> None:
    """python -m engine.load_memory in a fresh process (its high-water mark is the process')."""
    result = subprocess.run(
        [sys.executable, "-m", "engine.load_memory", "--model", "default", "--dtype", "bfloat16"]
        + ["--gguf-large-batch", "blocks"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    file_bytes = default_model_path().stat().st_size
    # The blocks, the float norms and the RoPE tables (8192 positions x 64 x cos/sin, bf16).
    assert measured["served_bytes"] <= 1.05 * file_bytes, measured
    assert measured["load_peak_bytes"] <= 1.2 * file_bytes + LOAD_ALLOWANCE, measured


@pytest.mark.parametrize("amx", [True, False])
def test_auto_keeps_a_bf16_copy_only_without_amx(amx) -> None:
    """gguf_large_batch "auto": on AMX the tiles and panels serve large passes from the blocks."""
    from engine.model_runner import _wants_bf16_copy

    class Kernels:
        @staticmethod
        def amx_available() -> bool:
            return amx

    assert _wants_bf16_copy("auto", Kernels()) is not amx
    assert _wants_bf16_copy("auto", None) is True  # no kernels: plain layers, nothing to read
    assert _wants_bf16_copy("bf16", Kernels()) is True
    assert _wants_bf16_copy("blocks", Kernels()) is False
    # Without AMX, auto keeps the copy only while it fits in half the available memory.
    gib = 2**30
    assert _wants_bf16_copy("auto", Kernels(), copy_bytes=4 * gib, available=8 * gib) is not amx
    assert _wants_bf16_copy("auto", Kernels(), copy_bytes=5 * gib, available=8 * gib) is False
    assert _wants_bf16_copy("bf16", Kernels(), copy_bytes=5 * gib, available=8 * gib) is True


def test_auto_reads_the_blocks_when_a_copy_would_not_fit(gguf_files, kernels, monkeypatch) -> None:
    """A runner with gguf_large_batch "auto" sizes the copy from its own GGUF layers."""
    from engine import model_runner

    path, _ = gguf_files["qwen2"]
    checkpoint = load_checkpoint(str(path))
    config = EngineConfig(model=str(path), dtype="bfloat16")
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: 2**40)
    roomy = ModelRunner(config, checkpoint, 64)
    linears = [m for m in roomy.model.modules() if isinstance(m, GGUFLinear)]
    copy_bytes = sum(2 * m.in_features * m.out_features for m in linears)
    assert model_runner._bf16_copy_bytes(roomy.model) == copy_bytes
    assert all((m.large is not None) is not kernels.amx_available() for m in linears)
    monkeypatch.setattr(model_runner, "available_memory_bytes", lambda: copy_bytes)
    tight = ModelRunner(config, checkpoint, 64)
    assert all(m.large is None for m in tight.model.modules() if isinstance(m, GGUFLinear))


@pytest.mark.parametrize("arch", sorted(CASES))
def test_int8_activations_as_close_to_the_oracle_as_hf_bf16(gguf_files, arch: str) -> None:
    """gguf_activations "int8": decode passes (1-8 rows) multiply the codes by int8 inputs,
    the decode stack included; along our greedy path the chosen tokens' log-probabilities stay
    within INT8_SLACK x HF bf16's own error of the float32 oracle. For Llama, the exact path
    beside it: the int8 one is really taken (its log-probabilities differ)."""
    path, oracle = gguf_files[arch]
    modes = ("int8", "exact") if arch == "llama" else ("int8",)
    engines = {
        mode: LLM(model=str(path), dtype="bfloat16", block_size=4, kv_cache_bytes=1 << 20,
                  gguf_activations=mode)
        for mode in modes
    }  # fmt: skip
    linears = [
        m for m in engines["int8"].engine.runner.model.modules() if isinstance(m, GGUFLinear)
    ]
    assert linears and all(m.int8_activations for m in linears)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    hf_bf16 = copy.deepcopy(oracle).to(torch.bfloat16)
    outputs = {mode: llm.generate(prompts(), greedy) for mode, llm in engines.items()}
    for prompt, output in zip(prompts(), outputs["int8"], strict=True):
        ours = torch.tensor([entry.logprob for entry in output.logprobs])
        want = chosen_logprobs(oracle, prompt, output.token_ids)
        hf_error = (chosen_logprobs(hf_bf16, prompt, output.token_ids) - want).abs().max()
        assert (ours - want).abs().max() <= INT8_SLACK * hf_error + 0.02, (arch, prompt)
    if "exact" in outputs:
        logprobs = {
            mode: [[e.logprob for e in o.logprobs] for o in outs] for mode, outs in outputs.items()
        }
        assert logprobs["int8"] != logprobs["exact"]


def test_int8_activations_refusals(gguf_files, kernels) -> None:
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig(gguf_activations="int8", batch_invariant=True)
    with pytest.raises(ValueError, match="'exact' or 'int8'"):
        EngineConfig(gguf_activations="int4")
    path, _ = gguf_files["llama"]  # blocks dequantized at load: no kernel reads them
    with pytest.raises(ValueError, match="needs a GGUF model's blocks read by the native"):
        LLM(model=str(path), dtype="bfloat16", gguf_activations="int8", gguf_matvec=False)
