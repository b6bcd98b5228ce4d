"""The AVX2 GGUF kernels (engine/kernels/csrc_avx2) against engine/gguf_blocks.py's plain-torch
dequantize (STYLE 11), per format: gguf_dequantize_f32 equal bit for bit, gguf_matvec_f32 at
every row count it serves and gguf_panel_f32 at any equal to x @ w.T up to fp32 summation order,
gguf_matvec_int8 equal to the inputs rounded by gguf_blocks.int8_inputs times w.T; and a tiny
GGUF served in float32 with gguf_activations "int8" equal to its plain-torch reference (every
linear layer's inputs rounded by int8_inputs).

They run on every x86 CPU with AVX2 + FMA + F16C (AVX-512 machines too), so CI tests them
everywhere; the serving path uses them only for float32 GGUF models.
"""

from __future__ import annotations

import types

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf_block_samples import COLS, KINDS, ROWS, make_blocks
from gguf_models import write_tiny_gguf
from test_gguf_checkpoint import CASES
from tiny_models import assert_greedy_equals_oracle, prompts
from torch.nn import functional as F

from engine import gguf_blocks
from engine.gguf_tensors import GGUFBlocks
from engine.kernels import load_avx2_kernels, load_cpu_kernels
from engine.llm import LLM
from engine.models.gguf_linear import GGUFLinear
from scheduler.sampling_params import SamplingParams

avx2 = load_avx2_kernels()
pytestmark = pytest.mark.skipif(avx2 is None, reason="no AVX2 + FMA + F16C, or no compiler")
# fp32 sums in another order than torch's: relative error ~ K * 2^-24 of the terms' magnitude.
F32_TOLERANCE = {"atol": 1e-4, "rtol": 1e-4}
# A whole model on int8 inputs against its reference: fp32 sums in another order move an input
# across a rounding boundary now and then (one code off by one); measured at most 3.1e-3 on a
# 2-core AMD EPYC (Zen 3), where int8 inputs move log-probabilities by ~0.2 from the exact path.
INT8_REFERENCE_TOLERANCE = 0.01


@pytest.mark.parametrize("kind", KINDS)
def test_dequantize_equals_the_reference_bit_for_bit(kind) -> None:
    blocks = make_blocks(kind, ROWS, COLS, seed=kind + 100)
    want = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_dequantize_f32(blocks, kind, ROWS, COLS)
    assert got.abs().max() > 0 and torch.equal(got, want)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8])
def test_matvec_matches_the_exact_weights(kind, rows) -> None:
    blocks = make_blocks(kind, ROWS, COLS, seed=rows)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS), torch.randn(ROWS)
    weights = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_matvec_f32(x, blocks, kind, ROWS, bias)
    torch.testing.assert_close(got, x @ weights.T + bias, **F32_TOLERANCE)
    torch.testing.assert_close(avx2.gguf_matvec_f32(x, blocks, kind, ROWS), x @ weights.T,
                               **F32_TOLERANCE)  # fmt: skip


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 9, 11, 64])
def test_panels_match_the_exact_weights(kind, rows) -> None:
    """Any row count (remainders of the 3-row blocks) and N not a multiple of the 4-row panels."""
    n = ROWS - 3
    blocks = make_blocks(kind, n, COLS, seed=rows + 7)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS), torch.randn(n)
    weights = gguf_blocks.dequantize(kind, blocks, COLS)
    got = avx2.gguf_panel_f32(x, blocks, kind, n, bias)
    torch.testing.assert_close(got, x @ weights.T + bias, **F32_TOLERANCE)


def test_matvec_rejects_what_it_cannot_read() -> None:
    q4_k = int(GGMLQuantizationType.Q4_K)
    blocks = make_blocks(q4_k, 4, 256, seed=0)
    x = torch.randn(1, 256)
    with pytest.raises(RuntimeError, match="unsupported ggml block type"):
        avx2.gguf_matvec_f32(x, blocks, int(GGMLQuantizationType.Q2_K), 4)
    with pytest.raises(RuntimeError, match="not a whole number"):
        avx2.gguf_matvec_f32(x[:, :64], blocks, q4_k, 4)
    with pytest.raises(RuntimeError, match="5 x 144"):
        avx2.gguf_matvec_f32(x, blocks, q4_k, 5)
    with pytest.raises(RuntimeError, match=r"\[1..8, K\]"):
        avx2.gguf_matvec_f32(torch.randn(9, 256), blocks, q4_k, 4)
    with pytest.raises(RuntimeError, match="float32"):
        avx2.gguf_matvec_f32(x.bfloat16(), blocks, q4_k, 4)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_int8_matvec_matches_its_reference(kind, rows) -> None:
    """gguf_matvec_int8 (gguf_int8.cpp) with a bias; past one row, the last row zeros (its
    scales 0). The integer sums are exact: only fp32 summation order remains."""
    blocks = make_blocks(kind, ROWS, COLS, seed=rows + 20)
    torch.manual_seed(rows)
    x, bias = torch.randn(rows, COLS), torch.randn(ROWS)
    if rows > 1:
        x[-1] = 0
    weights = gguf_blocks.dequantize(kind, blocks, COLS)
    want = gguf_blocks.int8_inputs(kind, x) @ weights.T
    got = avx2.gguf_matvec_int8(x, blocks, kind, ROWS, bias)
    torch.testing.assert_close(got, want + bias, **F32_TOLERANCE)
    torch.testing.assert_close(avx2.gguf_matvec_int8(x, blocks, kind, ROWS), want,
                               **F32_TOLERANCE)  # fmt: skip
    # Not the exact product: the inputs really were rounded.
    assert (got - (x @ weights.T + bias)).abs().max() > 1e-3


def test_int8_matvec_extreme_codes_do_not_overflow() -> None:
    """The largest codes times the largest inputs: Q6_K's 63 and 8-bit scales, Q8_0's -128 (its
    magnitude 128 in the unsigned operand), every input +-max so each rounds to +-127."""
    for kind in (int(GGMLQuantizationType.Q6_K), int(GGMLQuantizationType.Q8_0)):
        blocks = make_blocks(kind, ROWS, COLS, seed=5)
        fmt = gguf_blocks.block_format(kind)
        raw = blocks.view(ROWS, -1, fmt.block_bytes)
        if kind == int(GGMLQuantizationType.Q8_0):
            raw[..., 2:] = 0x80  # every code -128
        else:
            raw[..., :192] = 0xFF  # every code 63
            raw[..., 192:208] = 0x80  # every scale -128
        x = torch.where(torch.arange(COLS) % 3 == 0, -1.0, 1.0).repeat(2, 1)
        weights = gguf_blocks.dequantize(kind, blocks, COLS)
        want = gguf_blocks.int8_inputs(kind, x) @ weights.T
        got = avx2.gguf_matvec_int8(x, blocks, kind, ROWS)
        torch.testing.assert_close(got, want, **F32_TOLERANCE)


@pytest.fixture
def tiny_llama(tmp_path, monkeypatch):
    """A tiny Llama GGUF of Q4_K, Q6_K, Q8_0, Q4_0 and Q5_K blocks and its float32 HF oracle;
    its metadata cached under tmp_path, the kernels loaded first from the real cache (a build
    there would take minutes)."""
    load_cpu_kernels()
    monkeypatch.setenv("METERSERVE_CACHE_DIR", str(tmp_path / "cache"))
    formats, tied = CASES["llama"]
    return tmp_path / "llama.gguf", write_tiny_gguf(tmp_path / "llama.gguf", "llama", formats, tied)


def test_avx2_attention_gives_the_oracles_greedy_tokens(tiny_llama) -> None:
    """The avx2 attention backend (paged_attention.cpp) in a served float32 model, on every x86
    CPU: chunked prefills beside decodes, HF's greedy tokens. (Where the AVX-512 kernels do not
    build, auto picks it and the AVX2 layer ops, and every float32 model test runs on both.)"""
    path, oracle = tiny_llama
    llm, _, _ = assert_greedy_equals_oracle(path, oracle, "llama", True, attention_backend="avx2")
    assert llm.engine.runner.backend.name == "avx2"


def test_int8_inputs_in_float32_equal_their_plain_torch_reference(tiny_llama) -> None:
    """gguf_activations "int8" in float32 (the AVX2 path, every x86 CPU): each pass of 1-8 rows
    rounds its linear layers' inputs to int8. The same model with every GGUFLinear computing
    F.linear(gguf_blocks.int8_inputs(x), dequantized weights) instead is the reference: greedy
    tokens equal, log-probabilities within INT8_REFERENCE_TOLERANCE; the exact path's differ
    from both by far more (the int8 kernel is really taken)."""
    path, _ = tiny_llama
    engines = {
        mode: LLM(model=str(path), dtype="float32", block_size=4, kv_cache_bytes=1 << 20,
                  gguf_activations="exact" if mode == "exact" else "int8")
        for mode in ("int8", "reference", "exact")
    }  # fmt: skip
    linears = {
        mode: [m for m in llm.engine.runner.model.modules() if isinstance(m, GGUFLinear)]
        for mode, llm in engines.items()
    }
    assert linears["int8"] and all(m.avx2 is avx2 and m.int8_activations for m in linears["int8"])
    for linear in linears["reference"]:
        linear._part = types.MethodType(_int8_reference_part, linear)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, logprobs=0)
    outputs = {mode: llm.generate(prompts(), greedy) for mode, llm in engines.items()}
    for ours, want, exact in zip(*outputs.values(), strict=True):
        assert ours.token_ids == want.token_ids
        logprobs = torch.tensor([[e.logprob for e in o.logprobs] for o in (ours, want)])
        torch.testing.assert_close(logprobs[0], logprobs[1], atol=INT8_REFERENCE_TOLERANCE, rtol=0)
    int8_logprobs = [[e.logprob for e in o.logprobs] for o in outputs["int8"]]
    assert int8_logprobs != [[e.logprob for e in o.logprobs] for o in outputs["exact"]]


def _int8_reference_part(self, flat: torch.Tensor, part) -> torch.Tensor:
    rows_rounded = flat.shape[0] <= avx2.max_rows
    inputs = gguf_blocks.int8_inputs(part.kind, flat) if rows_rounded else flat
    return F.linear(inputs, part.dequantize())


def test_int8_inputs_need_the_blocks_read_by_a_kernel(tiny_llama) -> None:
    path, _ = tiny_llama
    with pytest.raises(ValueError, match="needs a GGUF model's blocks read by the native"):
        LLM(model=str(path), dtype="float32", gguf_activations="int8", gguf_matvec=False)


def test_a_large_part_keeps_the_panels_up_to_128_rows() -> None:
    """gguf_linear's AVX2 path: a part of 8 MiB or more in float32 reads its blocks on the
    panels up to AVX2_LARGE_PART_PANEL_ROWS rows (no float32 copy written per call), a smaller
    one up to AVX2_PANEL_ROWS; both equal x @ w.T, and bytes_read counts a copy only where one
    is made."""
    kind = int(GGMLQuantizationType.Q4_1)
    large, small = (make_blocks(kind, n, 1024, seed=n) for n in (2048, 64))
    layers = {}
    for name, blocks in (("large", large), ("small", small)):
        layer = GGUFLinear([GGUFBlocks(kind, blocks.view(blocks.shape[0], -1), 1024)], 1024, None,
                           torch.float32)  # fmt: skip
        layer.use_avx2_kernels(avx2)
        layers[name] = (layer, blocks.numel())
    for rows, copied in ((64, set()), (100, {"small"}), (129, {"large", "small"})):
        x = torch.randn(rows, 1024)
        for name, (layer, block_bytes) in layers.items():
            weights = gguf_blocks.dequantize(kind, layer.parts[0].blocks, 1024)
            torch.testing.assert_close(layer(x), x @ weights.T, **F32_TOLERANCE)
            copy_bytes = weights.numel() * 4 if name in copied else 0
            assert layer.bytes_read(rows) == block_bytes + copy_bytes, (name, rows)
