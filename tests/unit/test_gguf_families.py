"""GGUF files of Gemma 2, Gemma 3, Phi-3 and Granite served natively (engine/gguf_config.py).

Tiny random files written as llama.cpp's convert_hf_to_gguf writes them (tests/unit/
gguf_models.py: names from gguf-py's per-architecture TensorNameMap, Gemma's norms stored as
1 + w, Granite's q/k rows interleaved as LlamaModel does, each family's metadata keys), in
block formats of every kind: greedy output in float32 equals Hugging Face `generate` on the
weights the blocks dequantize to, token for token, on the kernels and on plain torch; the
config read back from the metadata is the one the file was written from, with llama.cpp's
rules where the file is silent (Gemma's attention scale, which layers slide).

Checked by hand on 2026-12-07 with llama.cpp's own converter (the llama-cpp-python 0.3.36 sdist)
on tiny random checkpoints of each family, f32 and q8_0: greedy output equal to HF on the
original checkpoint (docs/benchmarks.md, "GGUF files of Gemma 2, Gemma 3, Phi-3 and Granite").
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGUFWriter
from gguf_models import EOS, VOCAB, T, write_tiny_gguf
from tiny_models import assert_greedy_equals_oracle, assert_stack_equals_layer_loop, prompts
from transformers import (
    Gemma2Config,
    Gemma3TextConfig,
    GraniteConfig,
    MixtralConfig,
    Phi3Config,
    Qwen3MoeConfig,
)

from engine.gguf_config import hf_config
from engine.gguf_header import GGUFHeader, TensorInfo, read_header
from engine.kernels import load_avx2_kernels, load_cpu_kernels
from engine.llm import LLM
from engine.loader import ModelLoadError, load_checkpoint
from engine.models.moe import SparseMoE
from scheduler.sampling_params import SamplingParams

WINDOW = 8
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 256,  # K-quant rows hold multiples of 256 weights
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": EOS,
    "pad_token_id": EOS,
}

# arch -> (HF config, formats by GGUF tensor role, tied LM head). Gemma's attention scale and
# sliding layers are what llama.cpp derives (query_pre_attn_scalar = head_dim; Gemma 2 slides
# every other layer from the first, Gemma 3 five of six).
CASES = {
    "gemma2": (
        lambda: Gemma2Config(
            **COMMON,
            num_hidden_layers=4,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=4.0,
        ),
        {
            "token_embd": T.Q8_0,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q6_K,
            "attn_output": T.Q5_K,
            "ffn_gate": T.Q4_0,
            "ffn_up": T.Q4_0,
            "ffn_down": T.Q6_K,
        },
        True,
    ),
    "gemma3": (
        lambda: Gemma3TextConfig(
            **COMMON,
            num_hidden_layers=6,
            head_dim=64,
            query_pre_attn_scalar=64,
            sliding_window=WINDOW,
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
            },
        ),
        {
            "token_embd": T.F16,
            "attn_q": T.Q5_K,
            "attn_k": T.Q5_K,
            "attn_v": T.Q8_0,
            "attn_output": T.Q4_1,
            "ffn_gate": T.Q4_K,
            "ffn_up": T.Q4_K,
            "ffn_down": T.Q5_0,
        },
        True,
    ),
    "phi3": (
        lambda: Phi3Config(
            **COMMON,
            num_hidden_layers=2,
            sliding_window=WINDOW,
            original_max_position_embeddings=128,
            tie_word_embeddings=False,
        ),
        {
            "token_embd": T.Q8_0,
            "output": T.Q6_K,
            "attn_qkv": T.Q8_0,
            "attn_output": T.Q5_1,
            "ffn_up": T.Q4_K,
            "ffn_down": T.Q5_K,
        },
        False,
    ),
    "granite": (
        lambda: GraniteConfig(
            **COMMON,
            num_hidden_layers=2,
            embedding_multiplier=4.0,
            attention_multiplier=0.05,
            residual_multiplier=0.6,
            logits_scaling=2.5,
            tie_word_embeddings=False,
        ),
        {
            "token_embd": T.Q4_K,
            "output": T.Q8_0,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q4_1,
            "attn_output": T.Q8_0,
            "ffn_gate": T.Q5_K,
            "ffn_up": T.Q5_K,
            "ffn_down": T.Q6_K,
        },
        False,
    ),
    # Experts stacked per layer ([E, rows, cols], as the converter writes them), in blocks of
    # other formats than the layer's attention; every expert picked by some prompt token.
    "qwen3moe": (
        lambda: Qwen3MoeConfig(
            **COMMON,
            num_hidden_layers=2,
            head_dim=64,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=512,
            norm_topk_prob=True,
            tie_word_embeddings=True,
        ),
        {
            "token_embd": T.Q8_0,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q6_K,
            "attn_output": T.Q8_0,
            "ffn_gate_inp": T.F32,
            "ffn_gate_exps": T.Q4_K,
            "ffn_up_exps": T.Q5_0,
            "ffn_down_exps": T.Q6_K,
            "blk.1.ffn_down_exps": T.Q4_K,  # layers differ, as in a Q4_K_M file
        },
        True,
    ),
    "mixtral": (
        lambda: MixtralConfig(
            **{**COMMON, "intermediate_size": 256},
            num_hidden_layers=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
        ),
        {
            "token_embd": T.Q4_K,
            "output": T.Q6_K,
            "attn_q": T.Q4_K,
            "attn_k": T.Q4_K,
            "attn_v": T.Q8_0,
            "attn_output": T.Q5_K,
            "ffn_gate_exps": T.Q4_1,
            "ffn_up_exps": T.Q4_1,
            "ffn_down_exps": T.Q8_0,
        },
        False,
    ),
}
# The architecture a case's file states: Mixtral's files are llama files with experts.
ARCH = {"mixtral": "llama"}


@pytest.fixture(scope="module")
def gguf_files(tmp_path_factory) -> dict[str, tuple[Path, object]]:
    """arch -> (the file, its float32 HF oracle). The kernels are loaded first, from the real
    cache: _cache_dir below points the metadata cache at a temporary directory, and a kernel
    build there would take minutes."""
    load_cpu_kernels()
    load_avx2_kernels()
    root = tmp_path_factory.mktemp("gguf-families")
    files = {}
    for case, (config, formats, tied) in CASES.items():
        path = root / f"tiny-{case}.gguf"
        files[case] = (path, write_tiny_gguf(path, ARCH.get(case, case), formats, tied, config()))
    return files


@pytest.fixture(autouse=True)
def _cache_dir(tmp_path_factory, monkeypatch) -> None:
    monkeypatch.setenv("METERSERVE_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "plain-torch"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_greedy_equals_hugging_face_float32(gguf_files, arch: str, cpu_kernels: bool) -> None:
    path, oracle = gguf_files[arch]  # prompts up to 30 tokens: past the 8-token window
    assert_greedy_equals_oracle(path, oracle, arch, cpu_kernels)


@pytest.mark.parametrize("arch", sorted(CASES))
def test_config_is_the_one_written(gguf_files, arch: str) -> None:
    path, _ = gguf_files[arch]
    read = load_checkpoint(str(path)).config
    written = CASES[arch][0]()  # EOS ids gain end-of-turn tokens: test_end_of_turn_tokens_...
    assert read.model_type == written.model_type
    keys = [
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "tie_word_embeddings",
        "query_pre_attn_scalar",
        "layer_types",
        "sliding_window",
        "attn_logit_softcapping",
        "final_logit_softcapping",
        "rope_parameters",
        "embedding_multiplier",
        "attention_multiplier",
        "residual_multiplier",
        "logits_scaling",
    ]
    for key in keys:
        if hasattr(written, key):
            want, got = getattr(written, key), getattr(read, key)
            if isinstance(want, float):
                assert got == pytest.approx(want, rel=1e-6), key  # stored as float32
            else:
                assert got == want, key


def _header(arch: str, layers: int, **values) -> GGUFHeader:
    metadata = {
        "general.architecture": arch,
        f"{arch}.block_count": layers,
        f"{arch}.embedding_length": 512,
        f"{arch}.feed_forward_length": 1024,
        f"{arch}.attention.head_count": 4,
        f"{arch}.attention.key_length": 256,
        f"{arch}.attention.layer_norm_rms_epsilon": 1e-6,
        f"{arch}.context_length": 128,
        f"{arch}.rope.freq_base": 10000.0,
        "tokenizer.ggml.eos_token_id": 1,
        **{f"{arch}.{k.replace('__', '.')}": v for k, v in values.items()},
    }
    return GGUFHeader(metadata, (TensorInfo("token_embd.weight", 0, (32, 512), 0),))


def test_gemma_rules_where_the_file_is_silent() -> None:
    """llama.cpp's rules: the 27B models (46 / 62 layers) scale attention by hidden / heads,
    the others by head_dim; the sliding period, or a per-layer pattern where the file has one."""
    assert hf_config(_header("gemma2", 4)).query_pre_attn_scalar == 256
    assert hf_config(_header("gemma2", 46)).query_pre_attn_scalar == 128
    assert hf_config(_header("gemma3", 62)).query_pre_attn_scalar == 128
    s, f = "sliding_attention", "full_attention"
    windowed = _header("gemma3", 7, attention__sliding_window=8)
    assert hf_config(windowed).layer_types == [s, s, s, s, s, f, s]
    pattern = _header("gemma3", 3, attention__sliding_window=8, attention__sliding_window_pattern=3)
    assert hf_config(pattern).layer_types == [s, s, f]
    flags = [True, False, False]
    pattern = _header(
        "gemma3", 3, attention__sliding_window=8, attention__sliding_window_pattern=flags
    )
    assert hf_config(pattern).layer_types == [s, f, f]
    # Gemma 3 without a window: every layer full; the local RoPE base defaults to HF's 10,000.
    config = hf_config(_header("gemma3", 2))
    assert config.layer_types == [f, f]
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0


def test_end_of_turn_ids_end_requests() -> None:
    """tokenizer.ggml.eot_token_id / eom_token_id join the EOS ids, as llama.cpp stops at them."""
    header = _header("gemma2", 2)
    header.metadata["tokenizer.ggml.eot_token_id"] = 7
    assert hf_config(header).eos_token_id == [1, 7]


def test_end_of_turn_tokens_end_requests_by_their_text(gguf_files) -> None:
    """As llama.cpp does, the vocabulary's end-of-turn tokens end a request with the file's
    EOS id: the tiny files' vocabulary (SmolLM2's) has <|endoftext|> (0) beside <|im_end|>."""
    config = load_checkpoint(str(gguf_files["gemma3"][0])).config
    assert config.eos_token_id == [EOS, 0]


def test_short_arrays_are_read(tmp_path: Path) -> None:
    path = tmp_path / "arrays.gguf"
    writer = GGUFWriter(str(path), "gemma3")
    writer.add_sliding_window_pattern([True, False, True])
    writer.add_token_types(list(range(2000)))  # long: only its length is kept
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    _write(writer)
    metadata = read_header(path).metadata
    assert metadata["gemma3.attention.sliding_window_pattern"] == [True, False, True]
    assert metadata["tokenizer.ggml.token_type"] == 2000


def test_longrope_phi3_is_refused(tmp_path: Path, gguf_files) -> None:
    """Phi-3.5 / Phi-4-mini files carry longrope factors: refused in one line, naming it, as
    their Hugging Face checkpoints are."""
    path = tmp_path / "longrope.gguf"
    writer = GGUFWriter(str(path), "phi3")
    header = read_header(gguf_files["phi3"][0])
    for key in ("block_count", "embedding_length", "feed_forward_length", "context_length"):
        writer.add_uint32(f"phi3.{key}", header.arch_value(key))
    writer.add_uint32("phi3.attention.head_count", 4)
    writer.add_float32("phi3.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_float32("phi3.rope.freq_base", 10000.0)
    writer.add_tensor("token_embd.weight", np.zeros((VOCAB, 256), dtype=np.float32))
    writer.add_tensor("rope_factors_long.weight", np.ones(32, dtype=np.float32))
    _write(writer)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    assert "longrope" in str(info.value) and "\n" not in str(info.value)


def test_experts_stay_in_their_blocks(gguf_files) -> None:
    """A GGUF's experts are served from the file's blocks (one copy), and the meter's bytes
    per expert run are those blocks'."""
    path, _ = gguf_files["qwen3moe"]
    llm = LLM(model=str(path), dtype="bfloat16", kv_cache_bytes=1 << 20)
    moe = [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]
    assert len(moe) == 2 and all(m.gguf_experts is not None for m in moe)
    gate_up, down = moe[0].gguf_experts[3]
    stored = read_header(path)
    kinds = {t.name: t.kind for t in stored.tensors}
    assert [p.kind for p in gate_up.parts] == [kinds["blk.0.ffn_gate_exps.weight"], T.Q5_0]
    assert [p.kind for p in down.parts] == [T.Q6_K]
    assert moe[0].bytes_per_expert == sum(p.nbytes for p in gate_up.parts) + down.parts[0].nbytes
    assert moe[1].bytes_per_expert < moe[0].bytes_per_expert  # its down is Q4_K, not Q6_K
    # The meter's expert bytes are each layer's experts run times that layer's expert size.
    runner = llm.engine.runner
    seen = []
    execute = runner.execute

    def counted(output):
        result = execute(output)
        runs = [m.num_experts_run for m in moe]
        seen.append((runner.expert_bytes_run, runs))
        return result

    runner.execute = counted
    outputs = llm.generate(prompts(), SamplingParams(max_tokens=4, temperature=0.0))
    assert all(len(o.token_ids) == 4 for o in outputs)
    for expert_bytes, runs in seen:
        assert 1 <= min(runs) and max(runs) <= 8
        assert expert_bytes == sum(n * m.bytes_per_expert for n, m in zip(runs, moe, strict=True))


@pytest.mark.parametrize("case", ["qwen3moe", "mixtral"])
def test_native_experts_equal_their_linears(gguf_files, case: str) -> None:
    """bf16 on the kernels: moe_experts_gguf (every picked expert in one native call) equals
    the loop over each expert's GGUFLinears, bit for bit, and runs the same experts, at row
    counts of every gguf_linear path (1-4 exact rows, 5-8 small-batch, tiles, panels)."""
    kernels = load_cpu_kernels()
    if kernels is None or not hasattr(kernels, "moe_experts_gguf"):
        pytest.skip("needs the native kernels with moe_experts_gguf")
    llm = LLM(model=str(gguf_files[case][0]), dtype="bfloat16", kv_cache_bytes=1 << 20)
    moe = next(m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE))
    assert moe.gguf_kernels is kernels
    gen = torch.Generator().manual_seed(0)
    for tokens in (1, 3, 6, 20, 70, 100):
        x = (0.5 * torch.randn(tokens, moe.hidden_size, generator=gen)).bfloat16()
        weights, picks = moe._route(x)  # one routing for both (torch's exp is not moe_route's)
        native = moe._gguf_experts_native(x, weights, picks)
        native_run = moe.num_experts_run
        loop = moe._experts_in_torch(x, weights, picks)
        loop_run = moe.num_experts_run
        assert torch.equal(native, loop), tokens
        assert torch.equal(moe(x), native)  # forward takes the native call
        assert native_run == loop_run


@pytest.mark.parametrize("case", ["qwen3moe", "mixtral"])
def test_gguf_experts_in_the_decode_stack_equal_the_layer_loop(
    gguf_files, tmp_path: Path, case: str
) -> None:
    """bf16 on the kernels: a GGUF MoE model's decode steps run in the native decode stack,
    moe_experts_gguf inside it, and give the tokens and logprobs of the layer loop bit for bit,
    greedy and seeded sampled; the meter's expert bytes are the same at every step (the stack
    counts each layer's bytes, as the loop does: qwen3moe's layers store their downs in other
    formats). 32 experts: a router the tiles take (a multiple of 32 outputs), as the stack
    needs. (gguf_files: for the kernels it loads first, from the real cache.)"""
    make_config, formats, tied = CASES[case]
    config = make_config()
    setattr(config, "num_local_experts" if case == "mixtral" else "num_experts", 32)
    path = tmp_path / f"stack-{case}.gguf"
    write_tiny_gguf(path, ARCH.get(case, case), formats, tied, config)
    llm = LLM(
        model=str(path),
        dtype="bfloat16",
        enable_prefix_caching=False,  # the second run prefills as the first
        block_size=4,
        kv_cache_bytes=1 << 20,
        max_num_batched_tokens=16,
    )
    with_stack_bytes, expert_bytes = assert_stack_equals_layer_loop(
        llm, prompts()[:3], lambda r: r.expert_bytes_run
    )
    assert with_stack_bytes == expert_bytes and min(expert_bytes) > 0


def test_other_expert_layouts_are_refused(tmp_path: Path) -> None:
    """Experts stored one tensor per expert (Mixtral files from before llama.cpp stacked them):
    refused in one line, naming the tensor, before a model without its MLPs could be built."""
    path = tmp_path / "old-mixtral.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_tensor("token_embd.weight", np.zeros((8, 32), dtype=np.float32))
    writer.add_tensor("blk.0.ffn_gate.0.weight", np.zeros((64, 32), dtype=np.float32))
    _write(writer)
    with pytest.raises(ModelLoadError) as info:
        load_checkpoint(str(path))
    message = str(info.value)
    assert "expert layout" in message and "blk.0.ffn_gate.0.weight" in message
    assert "\n" not in message


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
