"""--quantization int8 end to end on a tiny random Llama (tests/unit/tiny_models.py), served in
bf16: its logprobs close to a bf16 model whose linears hold the int8 weights dequantized (the
only difference left is the per-token activation rounding), its greedy tokens mostly those of
the plain bf16 model; the layers swapped and the bytes the meter counts; config errors.

Deterministic: seeded weights and prompts, and the int8 kernels add exact int32 sums, so every
figure asserted here is the same on each run (and on AMX and VNNI-only CPUs alike)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tiny_models import COMMON, prompts, save_random_model
from transformers import LlamaConfig, Qwen2Config

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm import LLM
from engine.models.int8_linear import Int8Linear, quantize_symmetric
from scheduler.sampling_params import SamplingParams
from server.settings import Settings

needs_kernels = pytest.mark.skipif(
    load_cpu_kernels() is None, reason="native CPU kernels not available"
)
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MAX_TOKENS = 12
CLEAR_MARGIN = 0.3  # top-1 minus top-2 logprob above which a greedy choice is clear


def _engine(path: Path, quantization: str = "none") -> LLM:
    return LLM(
        model=str(path),
        dtype="bfloat16",
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=16,
        quantization=quantization,
    )


def _prompt_logprobs(llm: LLM, token_ids: list[int]):
    """Teacher-forced: the logprob of each token after the first, and at each position the
    model's top-2 (token ids, logprobs)."""
    llm.engine.add_request("p", token_ids, SamplingParams(max_tokens=1, prompt_logprobs=2))
    values: list[float] = []
    tops: list[tuple[list[int], list[float]]] = []
    while llm.engine.has_unfinished_requests():
        for event in llm.engine.step().events:
            values.extend(entry.logprob for entry in event.prompt_logprobs)
            tops.extend((e.top_token_ids, e.top_logprobs) for e in event.prompt_logprobs)
    return torch.tensor(values), tops


def _save_dequantized(model, path: Path) -> None:
    """The same model with every decoder linear's weight replaced by its int8 form dequantized
    (quantized from the bf16 weight the server serves, per output row as Int8Linear does)."""
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in LINEARS:
                codes, scales = quantize_symmetric(module.weight.bfloat16())
                module.weight.copy_(codes.float() * scales[:, None])
    model.save_pretrained(path, safe_serialization=True)


@needs_kernels
def test_int8_tiny_llama_against_its_references(tmp_path: Path) -> None:
    model = save_random_model(LlamaConfig(**COMMON, tie_word_embeddings=True), tmp_path / "bf16")
    _save_dequantized(model, tmp_path / "deq")
    (tmp_path / "deq" / "tokenizer.json").write_bytes(
        (tmp_path / "bf16" / "tokenizer.json").read_bytes()
    )
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        source = tmp_path / "bf16" / name
        if source.exists():
            (tmp_path / "deq" / name).write_bytes(source.read_bytes())
    int8 = _engine(tmp_path / "bf16", "int8")
    plain = _engine(tmp_path / "bf16")
    dequantized = _engine(tmp_path / "deq")

    runner = int8.engine.runner
    assert runner.num_int8_layers == 4 * COMMON["num_hidden_layers"]  # qkv, o, gate_up, down
    assert not isinstance(runner.model.lm_head, Int8Linear)  # the tied head stays bf16
    assert runner.model.decode_stack is None  # the bf16 native stack steps aside

    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    prompt_list = prompts()
    int8_out = [o.token_ids for o in int8.generate(prompt_list, params)]
    plain_out = [o.token_ids for o in plain.generate(prompt_list, params)]
    assert [t[0] for t in int8_out] == [t[0] for t in plain_out]
    # Along bf16's greedy path (teacher-forced), int8 picks bf16's token wherever bf16's choice
    # is clear; a random tiny model has near-ties, where one flip changes all later tokens, so
    # free-running greedy sequences are not compared further.
    near_total = far_total = 0.0
    clear = 0
    for prompt, continuation in zip(prompt_list, plain_out, strict=True):
        sequence = prompt + continuation
        got, got_top = _prompt_logprobs(int8, sequence)
        near, _ = _prompt_logprobs(dequantized, sequence)
        far, far_top = _prompt_logprobs(plain, sequence)
        for mine, theirs in zip(got_top, far_top, strict=True):
            if theirs[1][0] - theirs[1][1] > CLEAR_MARGIN:
                clear += 1
                assert mine[0][0] == theirs[0][0]
        assert (got - near).abs().max() < 0.15
        near_total += float((got - near).abs().mean())
        far_total += float((got - far).abs().mean())
    assert clear >= 40  # of the 55 + 48 positions, 53 are clear: the check is not vacuous
    # The activation rounding alone (int8 vs its dequantized weights in bf16) moves logprobs
    # less than activation and weight rounding together (int8 vs bf16).
    assert near_total < far_total


@needs_kernels
def test_int8_meter_counts_int8_bytes(tmp_path: Path) -> None:
    save_random_model(LlamaConfig(**COMMON, tie_word_embeddings=True), tmp_path)
    runner = _engine(tmp_path, "int8").engine.runner
    layers = [m for m in runner.model.modules() if isinstance(m, Int8Linear)]
    int8_bytes = sum(layer.bytes_read(1) for layer in layers)
    norms = sum(
        p.numel() * p.element_size() for n, p in runner.model.named_parameters() if "norm" in n
    )
    bytes_ = runner.weight_bytes()
    assert bytes_.body_small == bytes_.body_large == int8_bytes + norms
    codes = sum(layer.out_features * layer.in_features for layer in layers)
    assert int8_bytes == codes + sum(8 * layer.out_features for layer in layers)


def test_quantization_config_errors() -> None:
    with pytest.raises(ValueError, match="quantization"):
        EngineConfig(quantization="int4")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="float32"):
        EngineConfig(quantization="int8", dtype="float32")
    with pytest.raises(ValueError, match="cpu_kernels"):
        EngineConfig(quantization="int8", cpu_kernels=False)
    assert EngineConfig().quantization == "none"
    assert Settings.from_args(["--quantization", "int8"]).engine.quantization == "int8"
    assert Settings.from_args([], {"METERSERVE_QUANTIZATION": "int8"}).engine.quantization == "int8"


@needs_kernels
def test_int8_layers_with_bias_are_quantized_after_loading(tmp_path: Path) -> None:
    # Qwen2's q/k/v have biases, loaded after the weights: those layers convert in the
    # runner's second pass, bias carried; greedy's first tokens still bf16's.
    save_random_model(Qwen2Config(**COMMON, tie_word_embeddings=False), tmp_path)
    int8, plain = _engine(tmp_path, "int8"), _engine(tmp_path)
    qkv = int8.engine.runner.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int8Linear) and qkv.bias is not None
    assert int8.engine.runner.num_int8_layers == 4 * COMMON["num_hidden_layers"]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    first = [o.token_ids for o in int8.generate(prompts(), params)]
    assert first == [o.token_ids for o in plain.generate(prompts(), params)]
