"""Peak resident memory of loading a model, against the bytes of the weights it serves.

`python -m engine.load_memory --model DIR [--dtype bfloat16]` loads the model in this process
the way the engine does (checkpoint, then the model runner: build, read, cast, fuse, pack; no
KV cache) and prints one JSON object:
- baseline_rss_bytes: resident memory before loading, once the code loading runs is imported:
  torch, the native kernels, and transformers' config and tokenizer code (by reading the
  model's config and tokenizer once and dropping them; for a GGUF file, from its metadata
  cache, written then if missing). None of it grows with the model;
- load_peak_bytes: the resident high-water mark during loading minus that baseline (VmHWM,
  reset at the baseline through /proc/self/clear_refs where the kernel allows it);
- served_bytes: the bytes of every tensor the loaded model keeps (parameters, buffers, each
  linear layer's kernel layouts), a tensor two modules share counted once;
- weight_bytes: the parameters once in the serving dtype (what the checkpoint "is");
- load_peak_over_served, load_peak_over_weights: the ratios.
Run it in a fresh process: the high-water mark covers the whole process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

STATUS = Path("/proc/self/status")


def status_bytes(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    for line in STATUS.read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not permitted."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def served_bytes(model: torch.nn.Module) -> int:
    """Bytes of the distinct tensors held by the model's modules: parameters, buffers and
    plain tensor attributes (a PackedLinear's layouts, dataclasses of tensors inside it)."""
    seen: dict[int, int] = {}
    for module in model.modules():
        for value in _held_values(module):
            for tensor in _tensors_in(value):
                key, size = _storage_of(tensor)
                seen[key] = max(seen.get(key, 0), size)
    return sum(seen.values())


def _held_values(module: torch.nn.Module):
    yield from module._parameters.values()
    yield from module._buffers.values()
    yield from vars(module).values()


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, tuple | list):  # a GGUFLinear's parts
        for inner in value:
            yield from _tensors_in(inner)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            inner = getattr(value, field.name)
            if isinstance(inner, torch.Tensor):
                yield inner


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    if tensor.is_meta:
        return id(tensor), 0
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (RuntimeError, NotImplementedError):  # opaque layouts (mkldnn) have no storage
        return id(tensor), tensor.numel() * tensor.element_size()


def measure(model: str, dtype: str, gguf_large_batch: str = "auto") -> dict[str, object]:
    from engine.config import EngineConfig
    from engine.kernels import load_cpu_kernels
    from engine.loader import load_checkpoint
    from engine.model_runner import ModelRunner

    config = EngineConfig(model=model, dtype=dtype, gguf_large_batch=gguf_large_batch)
    if config.cpu_kernels:
        load_cpu_kernels()
    _import_loading_code(model)
    baseline = status_bytes("VmRSS")
    peak_reset = reset_peak()
    started = time.perf_counter()
    checkpoint = load_checkpoint(model)
    limit = getattr(checkpoint.config, "max_position_embeddings", None) or 2048
    runner = ModelRunner(config, checkpoint, limit)
    seconds = time.perf_counter() - started
    peak = status_bytes("VmHWM") - baseline
    served = served_bytes(runner.model)
    weights = runner.num_params * runner.dtype_bytes
    return {
        "model": checkpoint.name,
        "dtype": str(runner.dtype).removeprefix("torch."),
        "num_params": runner.num_params,
        "baseline_rss_bytes": baseline,
        "peak_reset": peak_reset,
        "load_peak_bytes": peak,
        "served_bytes": served,
        "weight_bytes": weights,
        "load_peak_over_served": round(peak / served, 3),
        "load_peak_over_weights": round(peak / weights, 3),
        "served_over_weights": round(served / weights, 3),
        "load_seconds": round(seconds, 2),
    }


def _import_loading_code(model: str) -> None:
    """Import what reading a config and a tokenizer imports (~100 MB of modules, a fixed cost
    that does not grow with the model), by reading them once."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.loader import resolve_model_path

    path = resolve_model_path(model)
    if path.suffix == ".gguf":
        from engine.gguf_checkpoint import metadata_dir

        path = metadata_dir(path)
    AutoConfig.from_pretrained(path)
    AutoTokenizer.from_pretrained(path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.load_memory", description=__doc__)
    parser.add_argument("--model", default="default")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "auto"])
    parser.add_argument("--gguf-large-batch", default="auto", choices=["auto", "bf16", "blocks"])
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.model, args.dtype, args.gguf_large_batch)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
