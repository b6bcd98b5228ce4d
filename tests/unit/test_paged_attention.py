"""Paged attention backends against dense causal attention on random tensors.

Each request's full K/V sequence is drawn at random; the tokens before its chunk are written
into the paged cache beforehand (at the slots of a shuffled, non-contiguous block table), the
chunk's own K/V are passed in as the step's new tokens. The backend must write the new K/V at
their slots and return, for every query row, exactly what plain softmax(QK^T)V over that
request's positions 0..p (GQA: kv head = query head // group) gives.

Layers may also attend through a sliding window W (the query at position p sees keys
p - W < j <= p) and cap their scores (c * tanh(scores / c) before the softmax, Gemma 2's
softcap); the dense reference applies both the same way. Cache blocks wholly outside a window
may hold anything (freed blocks are replaced by a placeholder): a test fills them with NaN.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from engine.attention import BACKENDS, CpuKernelAttention, make_backend
from engine.forward_batch import build_lists, slot_of, to_tensors
from engine.kernels import load_avx2_kernels, load_cpu_kernels
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 32
BLOCK_SIZE = 4
NUM_BLOCKS = 64
SCALE = HEAD_DIM**-0.5


@dataclass
class RequestCase:
    """One request: its chunk covers positions [start, start + query_len)."""

    start: int
    query_len: int
    is_prompt_end: bool = True  # False: a mid-prompt prefill chunk (not a decode)

    @property
    def context_len(self) -> int:
        return self.start + self.query_len


# decodes with different contexts (1, 6, 13, 4), then prefill chunks: fresh, with prior
# context (a chunk of a long prompt / a recompute after a prefix hit), a fresh one, and a
# one-token mid-prompt chunk after them (query_len 1 but not among the leading decodes).
MIXED = [
    RequestCase(0, 1),
    RequestCase(5, 1),
    RequestCase(12, 1),
    RequestCase(3, 1),
    RequestCase(0, 7),
    RequestCase(8, 5),
    RequestCase(6, 9),
    RequestCase(0, 3),
    RequestCase(6, 1, is_prompt_end=False),
]


@dataclass(frozen=True)
class Masking:
    """A layer's attention options (None: off); boost multiplies SCALE, so that scores are
    large enough for the softcap's tanh to saturate."""

    sliding_window: int | None = None
    softcap: float | None = None
    boost: float = 1.0

    def first_visible(self, position: int) -> int:
        """The first key position the query at `position` sees."""
        if self.sliding_window is None:
            return 0
        return max(0, position - self.sliding_window + 1)

    def forward_kwargs(self) -> dict:
        return {
            "scale": SCALE * self.boost,
            "sliding_window": self.sliding_window,
            "softcap": self.softcap,
        }


PLAIN = Masking()
# W = 5 is shorter than most MIXED contexts: decodes over 6 and 13 tokens, chunks starting at
# 6 and 8. The softcap is 0.5 on scores of standard deviation ~2: most of them saturate.
MASKINGS = {
    "window": Masking(sliding_window=5),
    "softcap": Masking(softcap=0.5, boost=2.0),
    "window_and_softcap": Masking(sliding_window=5, softcap=0.5, boost=2.0),
}


def _dense_attention(q, k, v, start: int, masking: Masking = PLAIN) -> torch.Tensor:
    """q: [query_len, heads, dim] at positions start.., k/v: [context, kv_heads, dim]."""
    group = NUM_HEADS // NUM_KV_HEADS
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(NUM_HEADS):
        kh, vh = k[:, h // group].double(), v[:, h // group].double()
        scores = q[:, h].double() @ kh.T * (SCALE * masking.boost)  # [query_len, context]
        if masking.softcap is not None:
            scores = masking.softcap * torch.tanh(scores / masking.softcap)
        for i in range(q.shape[0]):
            visible = slice(masking.first_visible(start + i), start + i + 1)
            probs = torch.softmax(scores[i, visible], dim=-1)
            out[i, h] = probs @ vh[visible]
    return out


def _outside_window(case: RequestCase, block_index: int, masking: Masking) -> bool:
    """Whether block block_index of the request's table lies wholly before the window of the
    chunk's first query (no query of the chunk sees it)."""
    return (block_index + 1) * BLOCK_SIZE <= masking.first_visible(case.start)


def _build_step(cases: list[RequestCase], dtype: torch.dtype, seed: int, poison: Masking | None):
    """Random K/V per request, a shuffled block table each, prior context written in the cache.

    poison: the blocks wholly outside that window are filled with NaN instead, except block 0
    (the padding of the batched backend's decode tables, read under a -inf mask)."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    free_blocks = list(range(NUM_BLOCKS))
    rng.shuffle(free_blocks)
    key_cache = torch.zeros(NUM_BLOCKS * BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    chunks, full = [], []
    for index, case in enumerate(cases):
        n_blocks = -(-case.context_len // BLOCK_SIZE)
        table = [free_blocks.pop() for _ in range(n_blocks)]
        q = torch.randn(case.query_len, NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
        k = torch.randn(case.context_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        v = torch.randn(case.context_len, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
        for p in range(case.start):
            key_cache[slot_of(table, p, BLOCK_SIZE)] = k[p]
            value_cache[slot_of(table, p, BLOCK_SIZE)] = v[p]
        for b, block in enumerate(table):
            if poison is not None and block != 0 and _outside_window(case, b, poison):
                key_cache[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE] = float("nan")
                value_cache[block * BLOCK_SIZE : (block + 1) * BLOCK_SIZE] = float("nan")
        num_prompt = case.context_len if case.is_prompt_end else case.context_len + 5
        if case.query_len == 1 and case.start > 0 and case.is_prompt_end:
            num_prompt = case.start  # a decode: one token past the prompt
        chunks.append(
            ScheduledChunk(
                request_id=f"r{index}",
                token_ids=list(range(case.query_len)),
                start_position=case.start,
                block_table=table,
                samples=case.is_prompt_end,
                num_prompt_tokens=num_prompt,
                sampling_params=SamplingParams(),
                prompt_token_ids=[],
                output_token_ids=[],
            )
        )
        full.append((q, k, v))
    return chunks, full, key_cache, value_cache


# The kernels backend with its prefill path chosen, whatever this CPU's default is.
PREFILL_PATHS = {"native_prefill": True, "sdpa_prefill": False}


def _make_backend(name: str):
    if name in PREFILL_PATHS:
        return CpuKernelAttention(load_cpu_kernels(), native_prefill=PREFILL_PATHS[name])
    return make_backend(name, load_cpu_kernels(), load_avx2_kernels())


def _run_backend(name, cases, dtype, seed, masking: Masking = PLAIN, poison: bool = False):
    chunks, full, key_cache, value_cache = _build_step(
        cases, dtype, seed, masking if poison else None
    )
    batch = to_tensors(build_lists(chunks, BLOCK_SIZE), BLOCK_SIZE, dtype)
    query = torch.cat([q for q, _, _ in full])
    key = torch.cat([k[c.start :] for c, (_, k, _) in zip(cases, full, strict=True)])
    value = torch.cat([v[c.start :] for c, (_, _, v) in zip(cases, full, strict=True)])
    if name in ("cpu_kernels", *PREFILL_PATHS) and load_cpu_kernels() is None:
        pytest.skip("native CPU kernels are not available on this machine")
    if name == "avx2" and load_avx2_kernels() is None:
        pytest.skip("the AVX2 kernels are not available on this machine")
    backend = _make_backend(name)
    kwargs = masking.forward_kwargs()
    out = backend.forward(query, key, value, key_cache, value_cache, batch.meta, **kwargs)
    return chunks, full, key_cache, value_cache, out


def _check_against_dense(
    cases, dtype, seed, backend, atol, rtol, masking: Masking = PLAIN, poison: bool = False
):
    chunks, full, key_cache, value_cache, out = _run_backend(
        backend, cases, dtype, seed, masking, poison
    )
    assert out.shape == (sum(c.query_len for c in cases), NUM_HEADS, HEAD_DIM)
    assert out.dtype == dtype
    row = 0
    for case, chunk, (q, k, v) in zip(cases, chunks, full, strict=True):
        expected = _dense_attention(q, k, v, case.start, masking)
        got = out[row : row + case.query_len].double()
        torch.testing.assert_close(got, expected, atol=atol, rtol=rtol)
        row += case.query_len
        # The new tokens' K/V now sit at their slots (the cache holds the whole context).
        for p in range(case.context_len):
            block = chunk.block_table[p // BLOCK_SIZE]
            if poison and block != 0 and _outside_window(case, p // BLOCK_SIZE, masking):
                continue
            slot = slot_of(chunk.block_table, p, BLOCK_SIZE)
            assert torch.equal(key_cache[slot], k[p]) and torch.equal(value_cache[slot], v[p])


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("seed", [0, 1])
def test_mixed_batch_float32_equals_dense(backend: str, seed: int) -> None:
    _check_against_dense(MIXED, torch.float32, seed, backend, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mixed_batch_with_mid_prompt_chunk_equals_dense(backend: str) -> None:
    cases = [RequestCase(7, 1), RequestCase(4, 6, is_prompt_end=False), RequestCase(0, 5)]
    _check_against_dense(cases, torch.float32, 3, backend, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_decodes_only_and_prefills_only(backend: str) -> None:
    decodes = [RequestCase(s, 1) for s in (0, 2, 9, 17, 4)]
    _check_against_dense(decodes, torch.float32, 4, backend, atol=1e-5, rtol=1e-5)
    prefills = [RequestCase(0, 11), RequestCase(5, 2), RequestCase(12, 4)]
    _check_against_dense(prefills, torch.float32, 5, backend, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mixed_batch_bfloat16_close_to_dense(backend: str) -> None:
    # Inputs are bf16 (the dense reference reads the same bf16 values in float64); the output
    # is rounded to bf16 (~3 significant digits), and SDPA may accumulate in bf16.
    _check_against_dense(MIXED, torch.bfloat16, 6, backend, atol=3e-2, rtol=3e-2)


def test_backends_agree_with_each_other() -> None:
    available = {"cpu_kernels": load_cpu_kernels(), "avx2": load_avx2_kernels()}
    names = [n for n in BACKENDS if available.get(n, True) is not None]
    outs = [_run_backend(name, MIXED, torch.float32, 7)[-1] for name in names]
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_llama_shaped_decodes_on_kernels(dtype, monkeypatch) -> None:
    """SmolLM2's attention shape (9 query heads over 3 kv heads, head_dim 64) with 16-token
    blocks: the shape the kernels' AMX scoring path takes (block_size % 16 == 0)."""
    module = __import__(__name__, fromlist=["_"])
    for name, value in {
        "NUM_HEADS": 9,
        "NUM_KV_HEADS": 3,
        "HEAD_DIM": 64,
        "BLOCK_SIZE": 16,
    }.items():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(module, "SCALE", 64**-0.5)
    cases = [RequestCase(s, 1) for s in (0, 14, 15, 16, 17, 40, 47, 63)] + [RequestCase(5, 9)]
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    _check_against_dense(cases, dtype, 8, "cpu_kernels", atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_equal_length_fresh_prompts_next_to_other_chunks(backend: str) -> None:
    # Runs of equal-length whole prompts (which the kernels backend batches into one call),
    # broken by a prompt of another length and a chunk with prior context.
    cases = [RequestCase(3, 1), RequestCase(0, 6), RequestCase(0, 6), RequestCase(0, 6)]
    cases += [RequestCase(0, 4), RequestCase(0, 6), RequestCase(5, 6), RequestCase(0, 6)]
    cases += [RequestCase(0, 6)]
    _check_against_dense(cases, torch.float32, 11, backend, atol=1e-5, rtol=1e-5)
    _check_against_dense(cases, torch.bfloat16, 12, backend, atol=3e-2, rtol=3e-2)


def _llama_shape(monkeypatch, num_heads: int, num_kv_heads: int, head_dim: int) -> None:
    module = __import__(__name__, fromlist=["_"])
    shape = {"NUM_HEADS": num_heads, "NUM_KV_HEADS": num_kv_heads, "HEAD_DIM": head_dim}
    for name, value in {**shape, "BLOCK_SIZE": 16, "NUM_BLOCKS": 160}.items():
        monkeypatch.setattr(module, name, value)
    monkeypatch.setattr(module, "SCALE", head_dim**-0.5)


# Prefill chunks for the native kernel (32 keys a softmax block): whole prompts shorter and
# longer than a block and ending on one, chunks after a cached prefix (starting inside a
# block and on a block boundary), a one-token mid-prompt chunk, beside decodes.
PREFILL_SHAPES = [
    RequestCase(0, 1),
    RequestCase(40, 1),
    RequestCase(0, 5),
    RequestCase(0, 32),
    RequestCase(0, 131),
    RequestCase(37, 70, is_prompt_end=False),
    RequestCase(64, 33),
    RequestCase(90, 1, is_prompt_end=False),
]


@pytest.mark.parametrize("path", sorted(PREFILL_PATHS))
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_prefill_paths_on_llama_shapes_close_to_dense(path, heads, kv_heads, head_dim, monkeypatch):
    """SmolLM2's shape (9 query heads over 3 kv heads, head_dim 64) and a head_dim-128 one
    with 4 query heads per kv head, in bf16 (the only dtype the native prefill kernel takes)."""
    _llama_shape(monkeypatch, heads, kv_heads, head_dim)
    _check_against_dense(PREFILL_SHAPES, torch.bfloat16, 13, path, atol=3e-2, rtol=3e-2)


def test_native_prefill_agrees_with_torch_sdpa_on_a_long_prompt(monkeypatch) -> None:
    """A 600-token prompt after a 70-token cached prefix: the native kernel and torch's SDPA
    read the same bf16 values and round the probabilities to bf16 alike."""
    _llama_shape(monkeypatch, 9, 3, 64)
    cases = [RequestCase(3, 1), RequestCase(70, 600), RequestCase(0, 45)]
    native = _run_backend("native_prefill", cases, torch.bfloat16, 14)[-1]
    sdpa = _run_backend("sdpa_prefill", cases, torch.bfloat16, 14)[-1]
    torch.testing.assert_close(native.float(), sdpa.float(), atol=1e-2, rtol=1e-2)


# ---- sliding windows and softcaps ---------------------------------------------------------

DTYPE_TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 3e-2}


def test_maskings_change_the_answer() -> None:
    """The options are not vacuous here: each moves the dense answer well past tolerance."""
    gen = torch.Generator().manual_seed(20)
    q = torch.randn(4, NUM_HEADS, HEAD_DIM, generator=gen)  # positions 9..12
    k, v = (torch.randn(13, NUM_KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    for masking in MASKINGS.values():
        plain = _dense_attention(q, k, v, 9, Masking(boost=masking.boost))
        assert (_dense_attention(q, k, v, 9, masking) - plain).abs().max() > 0.1


@pytest.mark.parametrize("masking", sorted(MASKINGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_mixed_batch_with_window_and_softcap_equals_dense(backend, dtype, masking) -> None:
    tolerance = DTYPE_TOLERANCES[dtype]
    _check_against_dense(MIXED, dtype, 21, backend, tolerance, tolerance, masking=MASKINGS[masking])


# Windows on SmolLM2's shape with 16-token blocks (the kernels' AMX decode scoring in bf16):
# decodes whose window starts inside a block, on one, past whole skipped blocks, and the
# prefill shapes (32-key softmax blocks of the native kernel) plus a chunk far past its window.
LONG_CASES = [RequestCase(s, 1) for s in (0, 14, 39, 40, 47, 63, 100, 200)]
LONG_CASES += PREFILL_SHAPES + [RequestCase(150, 40)]
LONG_MASKINGS = {
    "window5": Masking(sliding_window=5),
    "window40": Masking(sliding_window=40),
    "softcap": Masking(softcap=0.5, boost=2.0),
    "window40_and_softcap": Masking(sliding_window=40, softcap=0.5, boost=2.0),
}
KERNEL_PATHS = ["cpu_kernels", *sorted(PREFILL_PATHS)]


@pytest.mark.parametrize("masking", sorted(LONG_MASKINGS))
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(9, 3, 64), (8, 2, 128)])
def test_kernel_paths_with_window_and_softcap_close_to_dense(
    path, heads, kv_heads, head_dim, masking, monkeypatch
) -> None:
    """bf16: the native prefill kernel's only dtype, and the AMX decode path where it exists."""
    _llama_shape(monkeypatch, heads, kv_heads, head_dim)
    tolerance = DTYPE_TOLERANCES[torch.bfloat16]
    _check_against_dense(
        LONG_CASES, torch.bfloat16, 22, path, tolerance, tolerance, masking=LONG_MASKINGS[masking]
    )


@pytest.mark.parametrize("masking", ["window40", "window40_and_softcap"])
@pytest.mark.parametrize("backend", ["cpu_kernels", "avx2"])
def test_kernel_decodes_with_window_and_softcap_float32(backend, masking, monkeypatch) -> None:
    """The float32 decode kernels (AVX-512, and AVX2's) over long contexts with 16-token
    blocks, blocks outside the window poisoned."""
    _llama_shape(monkeypatch, 9, 3, 64)
    cases = [RequestCase(s, 1) for s in (0, 14, 39, 40, 47, 63, 100, 200)]
    masking = LONG_MASKINGS[masking]
    _check_against_dense(
        cases, torch.float32, 23, backend, 1e-5, 1e-5, masking=masking, poison=True
    )


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_blocks_outside_the_window_are_never_read(backend, dtype) -> None:
    """NaN in every block wholly before a chunk's window (0 * NaN would leak into the output)."""
    tolerance = DTYPE_TOLERANCES[dtype]
    masking = MASKINGS["window_and_softcap"]
    _check_against_dense(MIXED, dtype, 24, backend, tolerance, tolerance, masking, poison=True)


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("masking", ["window5", "window40"])
def test_kernel_paths_never_read_blocks_outside_the_window(path, masking, monkeypatch) -> None:
    _llama_shape(monkeypatch, 9, 3, 64)
    tolerance = DTYPE_TOLERANCES[torch.bfloat16]
    _check_against_dense(
        LONG_CASES,
        torch.bfloat16,
        25,
        path,
        tolerance,
        tolerance,
        LONG_MASKINGS[masking],
        poison=True,
    )
