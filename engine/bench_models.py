"""Random-weight Llama (and Qwen3-MoE) checkpoints of chosen sizes, for benchmarks of bigger
models (no download).

build_random_llama(spec, directory) writes a Hugging Face directory that meterserve, Hugging
Face and vLLM all load: config.json (LlamaForCausalLM), model.safetensors in bfloat16, and the
embedded SmolLM2 model's tokenizer (its 49,152-token vocabulary is the models' vocabulary, so
every id a model emits decodes). A spec with experts writes a Qwen3-MoE checkpoint
(Qwen3MoeForCausalLM: q/k norms, a router and per-expert weights under the names published
Qwen3-MoE checkpoints use, so vLLM reads the same file). Weights are N(0, 0.02) from one seeded generator drawn straight
into bfloat16 tensors, one tensor at a time (no float32 copy of the model ever exists); norms are
ones, as Hugging Face initialises them. The same spec and torch version give the same bytes.

A directory already holding the same spec (meterserve_random.json) is reused as is.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SPEC_FILE = "meterserve_random.json"


@dataclass(frozen=True, slots=True)
class RandomLlamaSpec:
    """A Llama-family model's shape; the vocabulary is the embedded tokenizer's."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    vocab_size: int = 49152
    max_position_embeddings: int = 8192
    rope_theta: float = 100000.0
    tie_word_embeddings: bool = True
    std: float = 0.02
    seed: int = 0
    num_experts: int = 0  # > 0: a Qwen3-MoE, every layer sparse, each expert of the size below
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        """Hugging Face name -> shape, in the order they are drawn from the generator."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab_size, h)}
        for i in range(self.num_layers):
            p = f"model.layers.{i}."
            shapes[p + "self_attn.q_proj.weight"] = (h, h)
            shapes[p + "self_attn.k_proj.weight"] = (kv, h)
            shapes[p + "self_attn.v_proj.weight"] = (kv, h)
            shapes[p + "self_attn.o_proj.weight"] = (h, h)
            if self.num_experts:
                shapes.update(self._moe_shapes(p))
            else:
                shapes[p + "mlp.gate_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.up_proj.weight"] = (self.intermediate_size, h)
                shapes[p + "mlp.down_proj.weight"] = (h, self.intermediate_size)
            shapes[p + "input_layernorm.weight"] = (h,)
            shapes[p + "post_attention_layernorm.weight"] = (h,)
        shapes["model.norm.weight"] = (h,)
        if not self.tie_word_embeddings:
            shapes["lm_head.weight"] = (self.vocab_size, h)
        return shapes

    def _moe_shapes(self, p: str) -> dict[str, tuple[int, ...]]:
        h, i = self.hidden_size, self.moe_intermediate_size
        shapes: dict[str, tuple[int, ...]] = {
            p + "self_attn.q_norm.weight": (self.head_dim,),
            p + "self_attn.k_norm.weight": (self.head_dim,),
            p + "mlp.gate.weight": (self.num_experts, h),
        }
        for e in range(self.num_experts):
            shapes[p + f"mlp.experts.{e}.gate_proj.weight"] = (i, h)
            shapes[p + f"mlp.experts.{e}.up_proj.weight"] = (i, h)
            shapes[p + f"mlp.experts.{e}.down_proj.weight"] = (h, i)
        return shapes

    @property
    def num_params(self) -> int:
        return sum(math.prod(shape) for shape in self.tensor_shapes().values())

    @property
    def num_active_params(self) -> int:
        """Parameters one token runs: all but the experts it is not routed to."""
        unused = self.num_experts - self.num_experts_per_tok
        return self.num_params - self.num_layers * unused * 3 * self.hidden_size * (
            self.moe_intermediate_size
        )


# Llama-style shapes (GQA, SwiGLU, tied embeddings as Qwen2.5 and Llama 3.2 small models tie):
# 0.5b ~ 0.49e9 parameters (24 x 1024, head_dim 64), 1.5b ~ 1.46e9 (24 x 2048, head_dim 128).
# Every linear dimension is a multiple of 32, as the AMX kernels tile.
RANDOM_MODELS = {
    "0.5b": RandomLlamaSpec(
        hidden_size=1024, intermediate_size=4864, num_layers=24, num_heads=16, num_kv_heads=8
    ),
    "1.5b": RandomLlamaSpec(
        hidden_size=2048, intermediate_size=7168, num_layers=24, num_heads=16, num_kv_heads=8
    ),
    # Qwen3-MoE-style (a scaled-down Qwen3-30B-A3B: 64 experts, 8 per token): ~2.5e9
    # parameters in all, ~0.43e9 active per token.
    "moe-2.5b-a0.4b": RandomLlamaSpec(
        hidden_size=1024,
        intermediate_size=0,
        num_layers=24,
        num_heads=16,
        num_kv_heads=4,
        num_experts=64,
        num_experts_per_tok=8,
        moe_intermediate_size=512,
    ),
}


def default_random_model_dir(size: str) -> Path:
    from engine.loader import cache_root

    return cache_root() / f"random-llama-{size}-seed{RANDOM_MODELS[size].seed}"


def build_random_llama(spec: RandomLlamaSpec, directory: Path) -> Path:
    """Write the checkpoint into `directory` unless it already holds this spec; returns it."""
    directory = Path(directory)
    if _holds(directory, spec):
        return directory
    log.info("building a random Llama of %.2fB parameters in %s", spec.num_params / 1e9, directory)
    tmp = directory.with_name(directory.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _write_weights(spec, tmp / "model.safetensors")
    tokenizer, reference = _embedded_tokenizer_and_config()
    tokenizer.save_pretrained(tmp)
    _hf_config(spec, reference).save_pretrained(tmp)
    (tmp / SPEC_FILE).write_text(json.dumps(asdict(spec), indent=1))
    shutil.rmtree(directory, ignore_errors=True)  # a different spec, or a partial build
    os.replace(tmp, directory)
    return directory


def _holds(directory: Path, spec: RandomLlamaSpec) -> bool:
    marker = directory / SPEC_FILE
    if not marker.is_file() or not (directory / "model.safetensors").is_file():
        return False
    return json.loads(marker.read_text()) == asdict(spec)


def _write_weights(spec: RandomLlamaSpec, path: Path) -> None:
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(spec.seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in spec.tensor_shapes().items():
        tensor = torch.empty(shape, dtype=torch.bfloat16)
        if name.endswith("norm.weight"):
            tensor.fill_(1.0)
        else:
            tensor.normal_(0.0, spec.std, generator=generator)
        tensors[name] = tensor
    save_file(tensors, str(path), metadata={"format": "pt"})


def _embedded_tokenizer_and_config():
    """The default (embedded SmolLM2) model's tokenizer and HF config."""
    from transformers import AutoConfig, AutoTokenizer

    from engine.loader import hf_checkpoint_dir

    source = hf_checkpoint_dir("default")
    return AutoTokenizer.from_pretrained(source), AutoConfig.from_pretrained(source)


def _hf_config(spec: RandomLlamaSpec, reference):
    from transformers import LlamaConfig, Qwen3MoeConfig

    if spec.num_experts:
        return Qwen3MoeConfig(
            architectures=["Qwen3MoeForCausalLM"],
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            intermediate_size=spec.moe_intermediate_size,
            moe_intermediate_size=spec.moe_intermediate_size,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[],
            num_hidden_layers=spec.num_layers,
            num_attention_heads=spec.num_heads,
            num_key_value_heads=spec.num_kv_heads,
            head_dim=spec.head_dim,
            max_position_embeddings=spec.max_position_embeddings,
            rope_theta=spec.rope_theta,
            rms_norm_eps=1e-6,
            tie_word_embeddings=spec.tie_word_embeddings,
            bos_token_id=reference.bos_token_id,
            eos_token_id=reference.eos_token_id,
            pad_token_id=reference.pad_token_id,
            dtype="bfloat16",
        )
    return LlamaConfig(
        architectures=["LlamaForCausalLM"],
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        rope_theta=spec.rope_theta,
        rms_norm_eps=1e-5,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=reference.bos_token_id,
        eos_token_id=reference.eos_token_id,
        pad_token_id=reference.pad_token_id,
        dtype="bfloat16",
    )
