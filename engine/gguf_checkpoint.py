"""A GGUF file served natively: config, tokenizer and weights from the file, nothing converted.

- Metadata: engine/gguf_header.py reads the architecture and the tensor index from the header
  bytes. The config and the tokenizer (with its chat template and EOS ids) come from
  transformers' GGUF support, which reads metadata only (no tensor); it parses every token and
  merge with gguf-py (~15 s and ~300 MB of Python objects for SmolLM2 on 2 cores), so the two
  are saved once as small JSON files under $METERSERVE_CACHE_DIR (<stem>-<digest>.meta/, keyed
  by the file's path, size and mtime) and read from there afterwards.
- Weights: GGUFWeights reads each tensor's bytes with pread(2) straight into memory the model
  keeps (no mmap: touched file pages would count toward resident memory), once. Linear weights
  stay in their block formats (engine/gguf_tensors.py; served by engine/models/gguf_linear.py),
  so the served model is the file's bytes plus float norms and biases: one copy.
- llama.cpp's converter interleaves the rows of q and k for the llama architecture (its RoPE
  pairs adjacent dims); Hugging Face's layout pairs dim d with d + head_dim / 2. Rows are
  independent in every block format, so the permutation is undone on whole stored rows while
  copying, as transformers' reverse_permute does on floats. qwen2 and qwen3 files are written
  unpermuted (convert_hf_to_gguf permutes in LlamaModel only; transformers undoes it only for
  "llama").
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch

from engine.gguf_config import builds_config, hf_config
from engine.gguf_header import GGUFFormatError, GGUFHeader, TensorInfo, read_header
from engine.gguf_tensors import FLOAT_DTYPES, GGUFBlocks, block_kinds, kind_name, row_bytes
from engine.loader import (
    LoadedCheckpoint,
    ModelLoadError,
    check_supported,
    gguf_cache_dir,
    one_line,
    publish_dir,
)

log = logging.getLogger(__name__)

SUPPORTED_ARCHITECTURES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "gemma2",
    "gemma3",
    "phi3",
    "granite",
)
# q/k rows interleaved by llama.cpp's converter (LlamaModel and its subclass GraniteModel).
PERMUTED_ARCHITECTURES = ("llama", "granite")
# Token texts llama.cpp ends generation at whatever the file's EOS id (llama-vocab.cpp's list,
# the entries of the families served).
END_OF_GENERATION_TEXTS = (
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|eom_id|>",
    "<EOT>",
    "<|end_of_text|>",
)
# Architectures whose tokenizer transformers' AutoTokenizer reads from a GGUF.
TRANSFORMERS_TOKENIZER_ARCHITECTURES = ("llama", "qwen2", "qwen3")
# Norm weights the converter stored as 1 + w (Gemma's RMSNorm scales by 1 + w): w is given back.
NORM_SHIFTED_ARCHITECTURES = ("gemma2", "gemma3")

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3's fused q|k|v, our layout
    "post_attention_norm": "post_attention_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    # A mixture-of-experts layer (Mixtral's llama files, qwen3moe): the router, and each of
    # gate, up and down for all experts in one [E, rows, cols] tensor (engine/models/moe.py).
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_exps",
    "ffn_up_exps": "mlp.experts.up_exps",
    "ffn_down_exps": "mlp.experts.down_exps",
}
# Where an architecture's tensor means something else (gguf-py's TensorNameMap per arch).
_ARCH_LAYER_NAMES = {
    "gemma2": {"ffn_norm": "pre_feedforward_layernorm"},
    "gemma3": {"ffn_norm": "pre_feedforward_layernorm"},
    "phi3": {"ffn_up": "mlp.gate_up_proj"},  # Phi-3's fused gate|up, our layout
}
_LAYER_TENSOR = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
# Experts stored some other way: gate and up fused in one tensor, or one tensor per expert
# (Mixtral files written before llama.cpp stacked them).
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate_up_exps|(gate|up|down)\.\d+)\.weight")
_IGNORED = ("rope_freqs.weight",)  # llama3 RoPE factors: the config's rope_parameters hold them


def hf_name(gguf_name: str, architecture: str = "llama") -> str | None:
    """The Hugging Face parameter name of a GGUF tensor, None for a name we do not map."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    match = _LAYER_TENSOR.fullmatch(gguf_name)
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(architecture, {})}
    if match is None or match.group(2) not in names:
        return None
    layer, part, leaf = match.groups()
    return f"model.layers.{layer}.{names[part]}.{leaf}"


class GGUFWeights(Mapping[str, torch.Tensor]):
    """A GGUF file's tensors by Hugging Face name, read on access (each once).

    `weights[name]` gives a float tensor (a block-format one dequantized: for code that wants
    floats); `is_blocks(name)` says a weight is stored in a block format and `read_blocks`
    reads weights as stored, stacking consecutive parts of one format into one buffer (a fused
    q|k|v or gate|up of one format is one read, into its final memory)."""

    def __init__(
        self,
        path: Path,
        tensors: dict[str, TensorInfo],
        permuted: dict[str, int],
        shifted: frozenset[str] = frozenset(),
    ):
        self.path = path
        self._tensors = tensors
        self._permuted = permuted  # HF name -> heads whose interleaved rows to undo
        self._shifted = shifted  # float tensors stored as 1 + w (Gemma's norms)

    def __getitem__(self, name: str) -> torch.Tensor:
        info = self._tensors[name]
        (part,) = self.read_blocks([name])  # rows of a 2-D q/k weight are unpermuted there
        if part.is_float:
            tensor = part.blocks.view(FLOAT_DTYPES[part.kind]).reshape(info.shape)
        else:
            tensor = part.dequantize().reshape(info.shape)
        if len(info.shape) == 1 and name in self._permuted:  # a llama q/k bias: by element
            tensor = tensor[_unpermute_order(tensor.shape[0], self._permuted[name])]
        if name in self._shifted:
            # Exact where 1 + w lies in [0.5, 2] (Sterbenz), as a norm weight does; the model
            # then forms 1 + w again, which gives back the stored float.
            tensor = tensor - 1.0
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._tensors)

    def __len__(self) -> int:
        return len(self._tensors)

    def is_blocks(self, name: str) -> bool:
        return self._tensors[name].kind not in FLOAT_DTYPES

    def read_blocks(self, names: list[str]) -> list[GGUFBlocks]:
        """The weights `names` stacked by rows, as stored: one GGUFBlocks per run of
        consecutive parts that share a format and width."""
        runs: list[list[tuple[str, TensorInfo]]] = []
        for name in names:
            info = self._tensors[name]
            last = runs[-1][0][1] if runs else None
            if last is not None and (last.kind, last.shape[-1]) == (info.kind, info.shape[-1]):
                runs[-1].append((name, info))
            else:
                runs.append([(name, info)])
        fd = os.open(self.path, os.O_RDONLY)
        try:
            return [self._read_run(fd, run) for run in runs]
        finally:
            os.close(fd)

    def _read_run(self, fd: int, run: list[tuple[str, TensorInfo]]) -> GGUFBlocks:
        """One buffer holding the run's tensors stacked by rows, each read once into place."""
        kind, cols = run[0][1].kind, run[0][1].shape[-1]
        rows = [_num_rows(info) for _, info in run]
        out = torch.empty(sum(rows), row_bytes(kind, cols), dtype=torch.uint8)
        first = 0
        for (name, info), n in zip(run, rows, strict=True):
            target = out[first : first + n]
            heads = self._permuted.get(name) if len(info.shape) == 2 else None
            if heads is None:
                _pread_into(fd, target, info.offset)
            else:  # read, then undo the interleave while copying into place
                stored = torch.empty_like(target)
                _pread_into(fd, stored, info.offset)
                torch.index_select(stored, 0, _unpermute_order(n, heads), out=target)
            first += n
        return GGUFBlocks(kind, out, cols)


def _num_rows(info: TensorInfo) -> int:
    rows = 1
    for size in info.shape[:-1]:
        rows *= size
    return rows


def _unpermute_order(rows: int, heads: int) -> torch.Tensor:
    """Stored row order -> HF order: HF row (h, half, i) is stored at (h, i, half), for head h,
    half in {0, 1}, i in [0, head_dim / 2); as transformers' reverse_permute."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(-1)


def _pread_into(fd: int, target: torch.Tensor, offset: int) -> None:
    view = memoryview(target.numpy()).cast("B")
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count == 0:
            raise ModelLoadError(f"GGUF file truncated at byte {offset + done}")
        done += count


def load_gguf_checkpoint(path: Path, name: str) -> LoadedCheckpoint:
    """Config, tokenizer and weights of a GGUF file; ModelLoadError (one line) for an
    architecture or tensor format we do not serve."""
    try:
        header = read_header(path)
    except (GGUFFormatError, OSError) as exc:
        raise ModelLoadError(f"cannot read GGUF file {path}: {exc}") from exc
    architecture = header.architecture
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(
            f"unsupported GGUF architecture {architecture!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    tensors = _mapped_tensors(header)
    config, tokenizer = _config_and_tokenizer(path, header)
    check_supported(config)
    permuted = _permuted_tensors(tensors, config) if architecture in PERMUTED_ARCHITECTURES else {}
    shifted = frozenset(
        name
        for name in tensors
        if architecture in NORM_SHIFTED_ARCHITECTURES and name.endswith("norm.weight")
    )
    weights = GGUFWeights(path, tensors, permuted, shifted)
    return LoadedCheckpoint(config, tokenizer, weights, name=name, source=str(path))


def _permuted_tensors(tensors: dict[str, TensorInfo], config) -> dict[str, int]:
    """HF name -> heads, for the q and k weights and biases llama.cpp interleaved."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    suffixes = {"self_attn.q_proj.": heads, "self_attn.k_proj.": kv_heads}
    return {name: count for name in tensors for suffix, count in suffixes.items() if suffix in name}


def _mapped_tensors(header: GGUFHeader) -> dict[str, TensorInfo]:
    """HF name -> tensor info; refuses a tensor format we cannot serve."""
    served = block_kinds()
    tensors: dict[str, TensorInfo] = {}
    for info in header.tensors:
        name = hf_name(info.name, header.architecture)
        if _EXPERT_TENSOR.fullmatch(info.name):
            raise ModelLoadError(
                f"unsupported GGUF expert layout ({info.name}): experts are served as "
                "separate gate, up and down tensors (ffn_gate_exps, ffn_up_exps, ffn_down_exps)"
            )
        if name is None:
            if info.name not in _IGNORED:
                log.warning("GGUF tensor %s is not used", info.name)
            continue
        dims = 3 if name.endswith("_exps.weight") else 2  # experts stacked: [E, rows, cols]
        if info.kind not in FLOAT_DTYPES and (info.kind not in served or len(info.shape) != dims):
            supported = ", ".join(sorted(kind_name(k) for k in served | set(FLOAT_DTYPES)))
            raise ModelLoadError(
                f"unsupported GGUF tensor type {kind_name(info.kind)} ({info.name}); "
                f"supported: {supported}"
            )
        tensors[name] = info
    return tensors


def _config_and_tokenizer(path: Path, header: GGUFHeader) -> tuple[object, object]:
    """From the metadata cache, made now from the file when missing."""
    from transformers import AutoConfig, AutoTokenizer

    meta = metadata_dir(path, header)
    try:
        return AutoConfig.from_pretrained(meta), AutoTokenizer.from_pretrained(meta)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata cache {meta}: {one_line(exc)}") from exc


def metadata_dir(path: Path, header: GGUFHeader | None = None) -> Path:
    """The file's metadata cache (config.json and tokenizer files), written now if missing."""
    meta = metadata_cache_dir(path)
    if not (meta / "config.json").is_file():
        _write_metadata_cache(path, read_header(path) if header is None else header, meta)
    return meta


def metadata_cache_dir(path: Path) -> Path:
    return gguf_cache_dir(path, ".meta")


def _write_metadata_cache(path: Path, header: GGUFHeader, meta: Path) -> None:
    log.info("reading the metadata of %s (first load; cached in %s)", path, meta)
    try:
        config = _read_config(path, header)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata of {path}: {one_line(exc)}") from exc
    check_supported(config)  # a model we refuse is refused before its vocabulary is parsed
    try:
        tokenizer = _read_tokenizer(path, header)
    except Exception as exc:
        raise ModelLoadError(f"cannot read GGUF metadata of {path}: {one_line(exc)}") from exc
    if builds_config(header):
        config.eos_token_id = end_of_generation_ids(config.eos_token_id, tokenizer)
    tmp = meta.with_name(meta.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    publish_dir(tmp, meta)


def end_of_generation_ids(eos, tokenizer) -> int | list[int] | None:
    """The file's EOS ids and those of the vocabulary's end-of-turn tokens llama.cpp stops at
    by their text (llama-vocab.cpp: Gemma's <end_of_turn>, Phi-3's <|end|>, ...): a GGUF has no
    generation_config.json to list a chat model's end-of-turn token. For the architectures
    gguf_config builds; llama, qwen2 and qwen3 files keep transformers' ids, as before."""
    ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    vocab = tokenizer.get_vocab()
    ids += [vocab[text] for text in END_OF_GENERATION_TEXTS if text in vocab]
    ids = list(dict.fromkeys(ids))
    return ids[0] if len(ids) == 1 else (ids or None)


def _read_config(path: Path, header: GGUFHeader):
    """engine/gguf_config.py's config where it builds one, else transformers'."""
    if builds_config(header):
        return hf_config(header)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    # transformers maps no key to head_dim, so a config class's default would stand (Qwen3's
    # 128) where the file says otherwise; llama.cpp writes it as attention.key_length.
    head_dim = header.arch_value("attention.key_length")
    if head_dim is not None:
        config.head_dim = int(head_dim)
    return config


def _read_tokenizer(path: Path, header: GGUFHeader):
    """transformers' tokenizer of the file. For an architecture its GGUF support does not know
    (granite), the same builders, picked by the file's tokenizer.ggml.model alone."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if header.architecture not in TRANSFORMERS_TOKENIZER_ARCHITECTURES:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (
            convert_gguf_tokenizer,
            get_gguf_tokenizer,
        )

        architecture, tokens, tokenizer_config = get_gguf_tokenizer(str(path))
        backend, extra = convert_gguf_tokenizer(architecture, tokens)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **tokenizer_config, **extra)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
