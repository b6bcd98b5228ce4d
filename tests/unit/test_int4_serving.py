"""--quantization int4 end to end on tiny random models (tests/unit/tiny_models.py), served in
bf16: every linear but the LM head becomes Q4_1 blocks that dequantize (gguf-py) to within
half a quantization step of the bf16 weight, read by the GGUF kernels with no bf16 copy; its
logprobs match a bf16 model holding those dequantized weights far more closely than the plain
bf16 model; a layer with a bias converts after its bias loads; the meter counts the blocks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf.quants import dequantize
from quantized_models import prompt_logprobs as _prompt_logprobs
from quantized_models import save_with_weights
from quantized_models import tiny_engine as _engine
from tiny_models import COMMON, prompts, save_random_model
from transformers import LlamaConfig, Qwen2Config

from engine.kernels import load_cpu_kernels
from engine.models.gguf_linear import GGUFLinear
from engine.models.int4_weights import INT4_KIND, int4_blocks
from server.settings import Settings

needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="native CPU kernels not available"
)


def _dequantized(layer: GGUFLinear) -> torch.Tensor:
    (part,) = layer.parts
    return torch.from_numpy(dequantize(part.blocks.numpy(), INT4_KIND)).float()


def test_int4_blocks_are_q4_1_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = (0.1 * torch.randn(8, 64, generator=gen)).to(torch.bfloat16)
    blocks = int4_blocks(weight)
    assert blocks.kind == int(INT4_KIND) and blocks.rows == 8 and blocks.cols == 64
    assert blocks.nbytes == 8 * 2 * 20  # two 20-byte blocks a row: 5 bits a weight
    back = torch.from_numpy(dequantize(blocks.blocks.numpy(), INT4_KIND))
    groups = weight.float().reshape(8, 2, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # a block's quantization step
    error = (back.reshape(8, 2, 32) - groups).abs()
    # half a step, plus the fp16 rounding of the block's scale and minimum
    assert bool((error <= step[..., None] * 0.5 + 2e-3 * groups.abs().amax()).all())


@needs_kernels
def test_int4_tiny_llama_against_its_dequantized_weights(tmp_path: Path) -> None:
    model = save_random_model(LlamaConfig(**COMMON, tie_word_embeddings=True), tmp_path / "bf16")
    int4 = _engine(tmp_path / "bf16", "int4")
    runner = int4.engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    assert runner.num_int4_layers == len(layers) == 4 * COMMON["num_hidden_layers"]
    assert not isinstance(runner.model.lm_head, GGUFLinear)  # the tied head stays bf16
    assert all(layer.large is None and layer.kernels is not None for layer in layers)
    assert runner.num_gguf_matvec_layers == len(layers)

    ours = runner.model  # a bf16 checkpoint holding exactly the int4 weights:
    weight_of = lambda name: _dequantized(ours.get_submodule(name))
    save_with_weights(model, weight_of, tmp_path / "bf16", tmp_path / "deq")
    plain, dequantized = _engine(tmp_path / "bf16"), _engine(tmp_path / "deq")
    near_total = far_total = 0.0
    for prompt in prompts():
        got, _ = _prompt_logprobs(int4, prompt)
        near, _ = _prompt_logprobs(dequantized, prompt)
        far, _ = _prompt_logprobs(plain, prompt)
        assert (got - near).abs().max() < 0.1  # the same weights; bf16 rounding apart
        near_total += float((got - near).abs().mean())
        far_total += float((got - far).abs().mean())
    assert near_total < 0.5 * far_total


@needs_kernels
def test_int4_layers_with_bias_and_the_bytes_the_meter_counts(tmp_path: Path) -> None:
    save_random_model(Qwen2Config(**COMMON, tie_word_embeddings=False), tmp_path)
    runner = _engine(tmp_path, "int4").engine.runner
    qkv = runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, GGUFLinear) and qkv.bias is not None
    assert runner.num_int4_layers == 4 * COMMON["num_hidden_layers"]
    layers = [m for m in runner.model.modules() if isinstance(m, GGUFLinear)]
    blocks = sum(part.nbytes for layer in layers for part in layer.parts)
    hidden, inter = COMMON["hidden_size"], COMMON["intermediate_size"]
    per_layer = hidden * 2 * hidden + hidden * hidden + 2 * inter * hidden + inter * hidden
    assert blocks == COMMON["num_hidden_layers"] * per_layer * 20 // 32
    biases = sum(2 * layer.bias.numel() for layer in layers if layer.bias is not None)
    norms = sum(
        p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "norm" in n
    )
    bytes_ = runner.weight_bytes()
    assert bytes_.body(1) == bytes_.body(64) == blocks + biases + norms


def test_int4_flag() -> None:
    assert Settings.from_args(["--quantization", "int4"]).engine.quantization == "int4"
