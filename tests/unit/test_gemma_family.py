"""Tiny random-weight Gemma 2 and Gemma 3 text models served like Hugging Face transformers.

Four layers with an 8-token sliding window (sliding and full layers both present, prompts
longer than the window), query_pre_attn_scalar unlike head_dim, and Gemma 2's soft-caps set
small enough to bend the scores. Gemma 3 runs a local RoPE base on sliding layers and linear
scaling on full ones, and head_dim * heads != hidden_size. float32 greedy equals HF `generate`
token for token, kernels on and off, with each chosen token's logprob (which sees the final
soft-cap, invisible to greedy argmax); bf16 leaves HF's bf16 path only at a near-tie.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_models import EOS, MAX_NEW_TOKENS, VOCAB, save_random_model
from tiny_models import prompts as _prompts
from transformers import AutoModelForCausalLM, Gemma2Config, Gemma3TextConfig

from engine.llm import LLM
from engine.loader import ModelLoadError, check_supported
from scheduler.sampling_params import SamplingParams

WINDOW = 8
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "sliding_window": WINDOW,
    "query_pre_attn_scalar": 24,
    "eos_token_id": EOS,
    "bos_token_id": 0,
    "pad_token_id": 0,
}
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]

FAMILIES = {
    "gemma2": lambda: Gemma2Config(
        **COMMON,
        head_dim=16,
        layer_types=LAYER_TYPES,
        attn_logit_softcapping=3.0,
        final_logit_softcapping=4.0,
    ),
    "gemma3": lambda: Gemma3TextConfig(
        **COMMON,
        head_dim=32,
        layer_types=["full_attention", *LAYER_TYPES[1:]],
        rope_parameters={
            "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
            "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        },
    ),
}
ENGINE = {"block_size": 4, "kv_cache_bytes": 1 << 20, "max_num_batched_tokens": 16}
GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)
LOGPROB_TOLERANCE = 1e-4  # float32
# bf16: where our tokens first differ from HF's, HF's own logits of the two tokens must be
# this close, relative to the largest logit magnitude of that step (a near-tie).
NEAR_TIE = 0.02


def _build_model(family: str, path: Path):
    # Gemma norms scale by 1 + weight: weights near 0 keep the scale near 1.
    return save_random_model(FAMILIES[family](), path, norm_center=0.0)


def _hf_generate(model, prompt: list[int]) -> tuple[list[int], list[torch.Tensor]]:
    """HF's greedy continuation and its logits at each step (float32)."""
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=MAX_NEW_TOKENS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
    )
    return out.sequences[0, len(prompt) :].tolist(), [step[0].float() for step in out.logits]


def _expected(model, prompts: list[list[int]], family: str):
    """Per prompt: HF's greedy tokens and their logprobs; fails on a near-tie along the way."""
    expected = []
    for prompt in prompts:
        tokens, logits = _hf_generate(model, prompt)
        margin = min(float(torch.topk(step, 2).values.diff().abs()) for step in logits)
        assert margin > 1e-3, f"{family}: HF's greedy path has a near-tie; pick another seed"
        logprobs = [
            float(torch.log_softmax(step, dim=-1)[token])
            for step, token in zip(logits, tokens, strict=True)
        ]
        expected.append((tokens, logprobs))
    return expected


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def checkpoint(request, tmp_path_factory) -> tuple[str, Path, object]:
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, _build_model(request.param, path)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "plain-torch"])
def test_greedy_equals_hugging_face_float32(checkpoint, cpu_kernels: bool) -> None:
    family, path, model = checkpoint
    prompts = _prompts()
    expected = _expected(model, prompts, family)
    llm = LLM(
        model=str(path),
        dtype="float32",
        attention_backend="auto" if cpu_kernels else "batched",
        cpu_kernels=cpu_kernels,
        **ENGINE,
    )
    assert llm.engine.runner.model.decode_stack is None
    params = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0, logprobs=0)
    outputs = llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == [tokens for tokens, _ in expected]
    for output, (tokens, logprobs) in zip(outputs, expected, strict=True):
        assert output.finish_reason == ("stop" if tokens[-1] == EOS else "length")
        ours = [entry.logprob for entry in output.logprobs]
        assert ours == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE)
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks == llm.engine.kv_cache_info.num_blocks


def test_batched_equals_alone_float32(checkpoint) -> None:
    _, path, _ = checkpoint
    prompts = _prompts()
    llm = LLM(model=str(path), dtype="float32", **ENGINE)
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    alone = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert batched == alone


def test_bf16_leaves_hugging_face_only_at_near_ties(checkpoint) -> None:
    family, path, _ = checkpoint
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    prompts = _prompts()
    llm = LLM(model=str(path), dtype="bfloat16", cpu_kernels=True, **ENGINE)
    outputs = llm.generate(prompts, GREEDY)
    for prompt, output in zip(prompts, outputs, strict=True):
        ref, ref_logits = _hf_generate(hf, prompt)
        for i, (ours, theirs) in enumerate(zip(output.token_ids, ref)):
            if ours != theirs:
                logits = ref_logits[i]
                gap = float(logits[theirs] - logits[ours])
                limit = NEAR_TIE * float(logits.abs().max())
                assert gap <= limit, f"{family}: position {i}: {ours} vs HF {theirs}, gap {gap}"
                break
        else:
            assert len(output.token_ids) == len(ref)


def test_an_eos_list_in_generation_config_stops(tmp_path: Path) -> None:
    """Gemma's generation_config.json lists several EOS ids (<eos>, <end_of_turn>)."""
    _build_model("gemma3", tmp_path)
    prompt = _prompts()[1]
    llm = LLM(model=str(tmp_path), dtype="float32", **ENGINE)
    (free,) = llm.generate([prompt], GREEDY)
    assert EOS not in free.token_ids
    extra = free.token_ids[2]
    (tmp_path / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": [EOS, extra]})
    )
    llm = LLM(model=str(tmp_path), dtype="float32", **ENGINE)
    (stopped,) = llm.generate([prompt], GREEDY)
    stop_at = free.token_ids.index(extra)
    assert stopped.token_ids == free.token_ids[: stop_at + 1]
    assert stopped.finish_reason == "stop"


def test_the_multimodal_wrapper_is_refused_with_a_reason() -> None:
    class Config:
        model_type = "gemma3"

    with pytest.raises(ModelLoadError, match="gemma3_text"):
        check_supported(Config())
