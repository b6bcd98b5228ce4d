"""The calibration behind --quantization int8's smoothing: each linear layer's input maxima.

SmoothQuant divides each activation channel by s[k] (and multiplies the weight's column by it)
before both are rounded to int8, s set from how large the channel gets on real text
(engine/models/int8_linear.py). Those maxima come from one bf16 prefill of the bundled
calibration text (engine/data/int8_calibration.txt: prose, a dialogue, code, JSON and figures,
written for this purpose; the perplexity text is kept out of it), max |x[:, k]| over its tokens,
recorded at the input of every linear layer the runner quantizes.

The prefill runs in a child process (`python -m engine.int8_calibration --model M --out F`),
so the serving process never holds the bf16 model whole (it quantizes layer by layer as it
loads); the result is cached under $METERSERVE_CACHE_DIR/int8-calibration, keyed by the
checkpoint's files and the text, so only a checkpoint's first int8 start pays for it (a few
seconds at 135M, the bf16 load and one prefill of ≈ 600 tokens at larger sizes).
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.loader import ModelLoadError, cache_root

log = logging.getLogger(__name__)

CALIBRATION_TEXT = Path(__file__).resolve().parent / "data" / "int8_calibration.txt"
VERSION = 1  # bump when what is measured changes
MIN_TOKENS = 64


def input_maxima(model_path: Path) -> dict[str, torch.Tensor]:
    """{linear module name: fp32 [in_features]} for the checkpoint at model_path, from the
    cache or measured now in a child process."""
    path = cache_path(model_path)
    if not path.is_file():
        log.info("int8: calibrating the smoothing on %s (once per checkpoint)", model_path)
        run_child(model_path, path)
    return load_file(path)


def cache_path(model_path: Path) -> Path:
    """Where the maxima of this checkpoint (its files' names, sizes and mtimes) are kept."""
    files = sorted(model_path.glob("*.safetensors")) if model_path.is_dir() else [model_path]
    key = [str(model_path.resolve()), f"v{VERSION}", _digest(CALIBRATION_TEXT.read_bytes())]
    key += [f"{f.name}:{f.stat().st_size}:{f.stat().st_mtime_ns}" for f in files]
    digest = _digest("\n".join(key).encode())
    return cache_root() / "int8-calibration" / f"{model_path.name}-{digest}.safetensors"


def run_child(model_path: Path, out: Path) -> None:
    """Measure in a child process; its error output becomes the error if it fails."""
    command = [sys.executable, "-m", "engine.int8_calibration", "--model", str(model_path)]
    done = subprocess.run(
        [*command, "--out", str(out)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0 or not out.is_file():
        tail = done.stderr.strip().splitlines()[-1:] or ["no output"]
        raise ModelLoadError(f"int8 calibration of {model_path} failed: {tail[0]}")


def measure(model: str) -> dict[str, torch.Tensor]:
    """Load `model` in bf16 (no native kernels: no fused decode stack, every linear runs its
    own forward) and prefill the calibration text once, recording max |input| per channel of
    each linear layer but the LM head."""
    from engine.llm import LLM  # the engine is only needed in the child
    from scheduler.sampling_params import SamplingParams

    llm = LLM(model=model, dtype="bfloat16", cpu_kernels=False, max_num_batched_tokens=4096)
    # Cut to the context (one position left for the token the prefill samples).
    token_ids = llm.tokenizer.encode(CALIBRATION_TEXT.read_text())[: llm.engine.max_model_len - 1]
    if len(token_ids) < MIN_TOKENS:
        raise ValueError(
            f"the tokenizer encodes the calibration text to {len(token_ids)} tokens "
            f"(at least {MIN_TOKENS} needed)"
        )
    maxima = recording_input_maxima(llm.engine.runner.model)
    llm.generate([token_ids], SamplingParams(max_tokens=1, temperature=0.0))
    return maxima


def recording_input_maxima(model: nn.Module) -> dict[str, torch.Tensor]:
    """From now on, every forward of model's linear layers but the LM head records max |input|
    per channel into the returned {module name: fp32 [in_features]}."""
    from engine.models.packed_linear import PackedLinear  # bf16 linears, packed at load

    maxima: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, PackedLinear)) and module is not model.lm_head:
            # An instance attribute: the model calls module.forward() directly, past hooks.
            module.forward = _recording(module.forward, maxima, name)
    return maxima


def _recording(forward, maxima: dict[str, torch.Tensor], name: str):
    """forward, recording max |input| per channel into maxima[name] first."""

    def record(x: torch.Tensor) -> torch.Tensor:
        peak = x.detach().float().reshape(-1, x.shape[-1]).abs().amax(dim=0)
        maxima[name] = peak if name not in maxima else torch.maximum(maxima[name], peak)
        return forward(x)

    return record


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True, type=Path)
    args = parser.parse_args(argv)
    maxima = measure(args.model)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.out.with_name(f"{args.out.name}.{os.getpid()}.tmp")
    save_file({name: value.contiguous() for name, value in maxima.items()}, tmp)
    os.replace(tmp, args.out)  # whole or absent, whoever else calibrates meanwhile
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
