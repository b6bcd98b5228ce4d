"""The native CPU kernels against the plain-torch code they replace (STYLE 11).

bfloat16 results of the row-wise kernels must equal torch's bit for bit (they round where the
torch chain rounds) except where an fp32 exp or sum order differs; matmul kernels are compared
with fp32 references at bf16 output precision. Paged attention is covered with the other
backends in test_paged_attention.py. Skipped where the kernels cannot be built (no AVX512-BF16
or no compiler): the plain-torch path then serves and is tested everywhere else.
"""

from __future__ import annotations

import functools
import gc
import operator
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants

from engine.kernels import load_cpu_kernels
from engine.models.layer_ops import KernelLayerOps, TorchLayerOps
from engine.models.layers import RotaryEmbedding

kernels = load_cpu_kernels()
pytestmark = pytest.mark.skipif(kernels is None, reason="native CPU kernels not available")
DTYPES = [torch.float32, torch.bfloat16]


def _ops():
    return TorchLayerOps(), KernelLayerOps(kernels)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 576), (5, 40), (33, 96)])
def test_rms_norm_and_fused_add_match_torch(dtype, rows, hidden) -> None:
    torch.manual_seed(rows + hidden)
    reference, fused = _ops()
    x, residual = torch.randn(rows, hidden, dtype=dtype), torch.randn(rows, hidden, dtype=dtype)
    weight = torch.randn(hidden, dtype=dtype)
    exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(
        fused.rms_norm(x, weight, 1e-5), reference.rms_norm(x, weight, 1e-5), **exact
    )
    want_normed, want_residual = reference.add_rms_norm(x, residual, weight, 1e-5)
    got_normed, got_residual = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    torch.testing.assert_close(got_residual, want_residual, atol=0, rtol=0)
    torch.testing.assert_close(got_normed, want_normed, **exact)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 40])
def test_rms_norm_heads_normalizes_those_heads_in_place(dtype, rows) -> None:
    """Qwen3's q and k norms: heads [2, 5) of rows 224 wide (head_dim 32), in place, equal to
    TorchLayerOps' (bit for bit in bf16, as rms_norm); the columns outside them untouched.
    40 rows take the threads."""
    torch.manual_seed(rows)
    reference, fused = _ops()
    x = torch.randn(rows, 224, dtype=dtype) * 3
    weight = torch.randn(32, dtype=dtype)
    want, got = x.clone(), x.clone()
    reference.rms_norm_heads_(want, 64, weight, 3, 1e-6)
    fused.rms_norm_heads_(got, 64, weight, 3, 1e-6)
    exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}
    torch.testing.assert_close(got, want, **exact)
    assert torch.equal(got[:, :64], x[:, :64]) and torch.equal(got[:, 160:], x[:, 160:])
    assert not torch.equal(got[:, 64:160], x[:, 64:160])
    with pytest.raises(RuntimeError, match="past the end"):
        fused.rms_norm_heads_(got, 200, weight, 1, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_matches_torch(dtype) -> None:
    torch.manual_seed(1)
    gate_up = torch.randn(19, 2 * 72, dtype=dtype) * 4
    reference, fused = _ops()
    # fp32 exp differs from torch's in the last bit or so: one bf16 ulp at most.
    tolerance = (
        {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 8e-3}
    )
    torch.testing.assert_close(
        fused.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tolerance
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_matches_torch(dtype) -> None:
    from transformers import LlamaConfig

    torch.manual_seed(2)
    heads, kv_heads, head_dim = 4, 2, 64
    rotary = RotaryEmbedding(LlamaConfig(head_dim=head_dim), head_dim, 256, dtype)
    qkv = torch.randn(7, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    positions = torch.tensor([0, 1, 5, 17, 100, 255, 3])
    reference, fused = _ops()
    want = reference.rotate_heads(
        qkv, reference.rotary_inputs(rotary, positions), heads + kv_heads, head_dim
    )
    got_qkv = qkv.clone()
    got = fused.rotate_heads(
        got_qkv, fused.rotary_inputs(rotary, positions), heads + kv_heads, head_dim
    )
    exact = {"atol": 0, "rtol": 0} if dtype == torch.bfloat16 else {"atol": 1e-6, "rtol": 1e-6}
    torch.testing.assert_close(got, want, **exact)
    # v (after q and k) is untouched.
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(got_qkv[:, v_start:], qkv[:, v_start:])


@pytest.mark.parametrize("dtype", DTYPES)
def test_store_kv_writes_rows_at_slots(dtype) -> None:
    qkv = torch.randn(3, 5 * 8, dtype=dtype)
    key, value = qkv[:, 16:24], qkv[:, 32:40]  # strided views, as in the model
    key_cache = torch.zeros(10, 2, 4, dtype=dtype)
    value_cache = torch.zeros(10, 2, 4, dtype=dtype)
    slots = torch.tensor([7, 0, 3])
    kernels.store_kv_(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache[slots].reshape(3, -1), key)
    assert torch.equal(value_cache[slots].reshape(3, -1), value)
    assert key_cache[[1, 2, 4, 5, 6, 8, 9]].abs().sum() == 0
    with pytest.raises(RuntimeError, match="out of"):
        kernels.store_kv_(key, value, key_cache, value_cache, torch.tensor([7, 0, 10]))


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])  # 5-8: two weight rows a tile
@pytest.mark.parametrize("features", [(96, 576), (40, 80)])  # K = 80: a masked 16-lane tail
def test_small_batch_linear_matches_fp32_matmul(rows, features) -> None:
    torch.manual_seed(rows)
    n, k = features
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    want = (x.float() @ weight.float().T + bias.float()).bfloat16()
    got = kernels.small_batch_linear(x, weight, bias)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])  # 5-8: two chains a row
@pytest.mark.parametrize("features", [(96, 576), (64, 2048)])
def test_tile_small_linear_matches_fp32_matmul_over_the_amx_layout(rows, features) -> None:
    # The tile layout is plain data (amx_pack_weight is a permute), so this runs on any CPU.
    torch.manual_seed(rows)
    n, k = features
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    packed = kernels.amx_pack_weight(weight)
    want = (x.float() @ weight.float().T + bias.float()).bfloat16()
    torch.testing.assert_close(
        kernels.tile_small_linear(x, packed, bias), want, atol=1e-2, rtol=1e-2
    )
    no_bias = kernels.tile_small_linear(x, packed, None)
    torch.testing.assert_close(
        no_bias, (x.float() @ weight.float().T).bfloat16(), atol=1e-2, rtol=1e-2
    )


# (rows, N, K): a register block's edges (rows % 8, slices % 3: N = 96, 64, 160 are 6, 4 and 10
# slices); K = 4160 takes three depth blocks, whose fp32 sums carry over, and at 200 rows two
# row chunks.
VECTOR_LINEAR_SHAPES = [(1, 96, 576), (5, 64, 96), (8, 160, 256), (37, 96, 576), (200, 64, 4160)]


@pytest.mark.parametrize("rows,n,k", VECTOR_LINEAR_SHAPES)
def test_vector_linear_matches_a_float64_matmul_over_the_tile_layout(rows, n, k) -> None:
    torch.manual_seed(rows + n + k)
    x = torch.randn(rows, k, dtype=torch.bfloat16)
    weight = torch.randn(n, k, dtype=torch.bfloat16)
    bias = torch.randn(n, dtype=torch.bfloat16)
    packed = kernels.amx_pack_weight(weight)
    exact = x.double() @ weight.double().T
    for b, want in ((bias, exact + bias.double()), (None, exact)):
        got = kernels.vector_linear(x, packed, b)
        # fp32 sums of bf16 products, rounded once to bf16: within bf16's half step of the
        # result plus fp32 summation error over k terms.
        tolerance = want.abs() * 2**-8 + 1e-6 * k * (x.double().abs() @ weight.double().abs().T)
        assert ((got.double() - want).abs() <= tolerance).all()


def test_vector_linear_rows_do_not_depend_on_the_batch() -> None:
    """Each element is one fp32 sum in order, in whatever register block its row falls: every
    row alone equals its row of a 37-row call bit for bit (the batch-invariant mode's
    promise on CPUs without AMX), also across depth blocks (K = 4160)."""
    for k in (576, 4160):
        torch.manual_seed(k)
        x = torch.randn(37, k, dtype=torch.bfloat16)
        packed = kernels.amx_pack_weight(torch.randn(96, k, dtype=torch.bfloat16))
        full = kernels.vector_linear(x, packed, None)
        for row in range(37):
            assert torch.equal(kernels.vector_linear(x[row : row + 1], packed, None)[0], full[row])


def test_vector_linear_of_no_rows_is_empty() -> None:
    """A step whose rows all skip the LM head multiplies 0 rows."""
    packed = kernels.amx_pack_weight(torch.randn(64, 96, dtype=torch.bfloat16))
    out = kernels.vector_linear(torch.empty(0, 96, dtype=torch.bfloat16), packed, None)
    assert out.shape == (0, 64)


def test_vector_linear_refuses_what_is_not_the_tile_layout() -> None:
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        kernels.vector_linear(x, torch.randn(64, 64, dtype=torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.vector_linear(x.float(), kernels.amx_pack_weight(x.repeat(8, 1)[:32]), None)


def test_amx_pack_layout_is_the_documented_one() -> None:
    weight = torch.arange(64 * 96, dtype=torch.float32).reshape(64, 96).bfloat16()
    packed = kernels.amx_pack_weight(weight)
    n, k = 37, 70  # packed[n / 16][k / 32][(k % 32) / 2][n % 16][k % 2] = weight[n][k]
    assert packed[n // 16, k // 32, (k % 32) // 2, n % 16, k % 2] == weight[n, k]


@pytest.mark.parametrize("rows", [1, 5, 31, 32, 33, 64, 100])
def test_amx_linear_matches_fp32_matmul(rows) -> None:
    if not kernels.amx_available():
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(rows)
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    weight = torch.randn(64, 96, dtype=torch.bfloat16)
    bias = torch.randn(64, dtype=torch.bfloat16)
    want = (x.float() @ weight.float().T + bias.float()).bfloat16()
    got = kernels.amx_linear(x, kernels.amx_pack_weight(weight), bias)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    no_bias = kernels.amx_linear(x, kernels.amx_pack_weight(weight), None)
    torch.testing.assert_close(
        no_bias, (x.float() @ weight.float().T).bfloat16(), atol=1e-2, rtol=1e-2
    )


@pytest.mark.parametrize("columns", [96, 128])
def test_amx_grouped_linear_is_amx_linear_per_expert(columns: int) -> None:
    """Each group's rows equal the fp32 reference, and those of groups over 2 rows (on the
    tiles) equal amx_linear over that expert alone, bit for bit; groups of 1-2 rows take the
    vector path, of 3-16 rows 16 x 64 blocks when the columns are a multiple of 64. Groups of
    0, 1, 2, 3, 4, 5, 16, 17, 31, 33 and 70 rows, experts out of order and repeated; at 96
    columns a group's second vector item covers 32 of its 64."""
    if not kernels.amx_available():
        pytest.skip("no AMX on this CPU")
    torch.manual_seed(3)
    weights = [torch.randn(columns, 96, dtype=torch.bfloat16) for _ in range(5)]
    packed = torch.stack([kernels.amx_pack_weight(w) for w in weights])
    plan = [
        (3, 1),
        (0, 0),
        (2, 2),
        (2, 3),
        (0, 4),
        (1, 5),
        (4, 16),
        (0, 17),
        (1, 31),
        (4, 33),
        (3, 70),
    ]
    total = sum(n for _, n in plan)
    x = torch.randn(total + 32, 96, dtype=torch.bfloat16)
    groups, first = [], 0
    for e, n in plan:
        groups.append((e, first, n))
        first += n
    got = kernels.amx_grouped_linear(x, packed, torch.tensor(groups))
    assert got.shape == (total, columns)
    for e, first, n in groups:
        if n:
            rows = x[first : first + n]
            alone = kernels.amx_linear(rows, kernels.amx_pack_weight(weights[e]), None)
            if n > 2:
                assert torch.equal(got[first : first + n], alone)
            want = (rows.float() @ weights[e].float().T).bfloat16()
            torch.testing.assert_close(got[first : first + n], want, atol=1e-2, rtol=1e-2)
    with pytest.raises(RuntimeError, match="disjoint"):
        kernels.amx_grouped_linear(x, packed, torch.tensor([(0, 5, 4), (1, 0, 4)]))
    with pytest.raises(RuntimeError, match="padding"):
        kernels.amx_grouped_linear(x[:10], packed, torch.tensor([(0, 0, 1)]))


@pytest.mark.parametrize(("columns", "depth"), [(96, 128), (160, 4160)])
def test_vector_grouped_linear_is_the_dense_kernels_per_expert(columns: int, depth: int) -> None:
    """The experts' product without AMX, over the tile layout, against the float64 reference
    (within a bf16 rounding of each output), and bit for bit the dense kernels over that expert
    alone: a group of more than 2 rows as vector_linear computes it (so each of its rows as
    that row alone), of 1-2 rows as tile_small_linear. Groups of 0, 1, 2, 3, 5, 17 and 70 rows,
    experts out of order and repeated; 96 and 160 columns leave items of fewer slices than a
    register block or a four-slice walk; K 4160 spans three depth blocks."""
    torch.manual_seed(4)
    weights = [torch.randn(columns, depth, dtype=torch.bfloat16) for _ in range(4)]
    experts = torch.stack([kernels.amx_pack_weight(w) for w in weights])
    plan = [(3, 1), (0, 0), (2, 2), (2, 3), (1, 5), (0, 17), (3, 70)]
    x = torch.randn(sum(n for _, n in plan), depth, dtype=torch.bfloat16)
    groups, first = [], 0
    for e, n in plan:
        groups.append((e, first, n))
        first += n
    got = kernels.vector_grouped_linear(x, experts, torch.tensor(groups))
    assert got.shape == (x.shape[0], columns)
    for e, first, n in groups[:1] + groups[2:]:  # every group but the empty one
        rows = x[first : first + n]
        want = rows.double() @ weights[e].double().T
        torch.testing.assert_close(got[first : first + n].double(), want, atol=5e-2, rtol=8e-3)
        dense = kernels.vector_linear if n > 2 else kernels.tile_small_linear
        assert torch.equal(got[first : first + n], dense(rows, experts[e], None))
    with pytest.raises(RuntimeError, match="disjoint"):
        kernels.vector_grouped_linear(x, experts, torch.tensor([(0, 5, 4), (1, 0, 4)]))
    with pytest.raises(RuntimeError, match="amx_pack_weight"):
        kernels.vector_grouped_linear(x, torch.stack(weights), torch.tensor([(0, 0, 1)]))


@pytest.mark.parametrize(("normalize", "round_weights"), [(True, True), (False, False)])
def test_moe_route_is_softmax_top_k_as_the_router_rounds(normalize, round_weights) -> None:
    """moe_route against SparseMoE's torch steps (softmax in float32, top-k, renormalized where
    the family does, rounded to bf16 where it does): the same picks in the same order (logits
    all different) and weights within a few float32 ulps (its exp is vec.h's, not torch's; one
    bf16 ulp once rounded). 64 experts, and 20 (a masked tail). A row of equal logits picks the
    lowest ids first."""
    torch.manual_seed(6)
    for experts in (64, 20):
        # Distinct logits, exactly representable in bf16: multiples of 1/8 in [-4, 4).
        logits = torch.stack([torch.randperm(experts) for _ in range(9)]) * 0.125 - 4
        logits = logits.bfloat16()
        weights, picks = kernels.moe_route(logits, 8, normalize, round_weights)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        want, want_picks = torch.topk(probs, 8, dim=-1)
        if normalize:
            want /= want.sum(dim=-1, keepdim=True)
        assert torch.equal(picks, want_picks)
        assert weights.dtype == (torch.bfloat16 if round_weights else torch.float32)
        tolerance = 2**-8 if round_weights else 4e-7
        torch.testing.assert_close(weights.float(), want, rtol=tolerance, atol=0)
    weights, picks = kernels.moe_route(torch.zeros(1, 16, dtype=torch.bfloat16), 4, True, False)
    assert picks.tolist() == [[0, 1, 2, 3]] and weights.tolist() == [[0.25] * 4]


def _one_expert_row(x_row: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x_row [1, K] @ weight.T as moe_experts multiplies a row of a group of more than 2 rows
    on this CPU: amx_linear's tiles with AMX, else vector_linear's register blocks (a row's
    result there does not depend on its batch)."""
    packed = kernels.amx_pack_weight(weight)
    if kernels.amx_available():
        return kernels.amx_linear(x_row, packed, None)
    return kernels.vector_linear(x_row, packed, None)


@pytest.mark.parametrize("weights_dtype", [torch.float32, torch.bfloat16])
def test_moe_experts_is_each_pick_through_its_expert_weighted_in_pick_order(weights_dtype) -> None:
    """moe_experts against its plain-torch reference, bit for bit: each (token, pick) row
    through its expert's product (gate_up: amx_linear over the tiles on an AMX CPU, else
    vector_linear over them), the kernels' silu_and_mul, the down product, each weighted
    product rounded to bf16 when the weights are bf16, the k products summed in pick order in
    float32 and rounded once. 16 experts, top-8 over 40 tokens: every expert gets more than 2
    rows (so its rows run as amx_linear's or vector_linear's do, not the 1-2-row walk), the picks
    of a token are out of expert order, and experts 14 and 15 are picked by no token and not
    counted."""
    torch.manual_seed(5)
    tokens, k, hidden, inter, num_experts = 40, 8, 64, 96, 16
    gate_up = [torch.randn(2 * inter, hidden, dtype=torch.bfloat16) * 0.2 for _ in range(16)]
    down = [torch.randn(hidden, inter, dtype=torch.bfloat16) * 0.2 for _ in range(16)]
    x = torch.randn(tokens, hidden, dtype=torch.bfloat16)
    picks = torch.stack([torch.randperm(14)[:k] for _ in range(tokens)])
    weights = torch.rand(tokens, k).to(weights_dtype)
    got, run = kernels.moe_experts(x, picks, weights, *_experts_layout(gate_up, down))
    assert run == len(set(picks.flatten().tolist())) == 14
    assert torch.bincount(picks.flatten(), minlength=num_experts)[:14].min() > 2
    want = torch.empty_like(got)
    for t in range(tokens):
        total = torch.zeros(hidden)
        for j in range(k):
            e = int(picks[t, j])
            hidden_row = kernels.silu_and_mul(_one_expert_row(x[t : t + 1], gate_up[e]))
            out = _one_expert_row(hidden_row, down[e])[0]
            product = out * weights[t, j : j + 1]  # bf16 x bf16 rounds; bf16 x fp32 is fp32
            total += product.float()
        want[t] = total.bfloat16()
    assert torch.equal(got, want)
    with pytest.raises(RuntimeError, match="expert"):
        kernels.moe_experts(x, picks + 3, weights, *_experts_layout(gate_up, down))


def _experts_layout(gate_up, down) -> tuple[torch.Tensor, torch.Tensor]:
    """The experts stacked as SparseMoE lays them out for the kernels: tiles, on every CPU."""
    return (
        torch.stack([kernels.amx_pack_weight(w) for w in gate_up]),
        torch.stack([kernels.amx_pack_weight(w) for w in down]),
    )


@pytest.mark.parametrize("dtype", DTYPES)
def test_argmax_rows_takes_the_first_maximum_like_torch(dtype) -> None:
    torch.manual_seed(9)
    logits = torch.randn(9, 1000, dtype=dtype)
    logits[2, 10] = logits[2, 500] = 30.0  # a tie: the first index wins
    logits[4, 999] = 40.0  # the last, in the masked tail of the row
    logits[6] = -1e30  # all equal
    got = kernels.argmax_rows(logits)
    assert torch.equal(got, logits.float().argmax(dim=-1))
    assert got[2] == 10 and got[4] == 999 and got[6] == 0


# --- The GIL -------------------------------------------------------------------------------------
# Every op but amx_available releases the GIL, so the HTTP thread runs while a step computes.
# Proof without timing: a Python thread counts in a loop while the main thread calls the op
# REPEATS times inside one C-level map() that also reads the counter before and after. No bytecode
# runs between the two readings, so the main thread gives up the GIL in between only where a call
# releases it: a call that keeps it reads exactly 0, every time. A call that releases it lets the
# waiting counter in (and once the counter has waited a 5 ms switch interval, CPython's forced
# switching makes the next release hand the GIL over), so it reads > 0 within a few tries.
# REPEATS is small because each handover can cost the caller a switch interval to get it back.

REPEATS = 16
DEADLINE_SECONDS = 2.0  # tries until then; a call that keeps the GIL uses all of it


def _python_progress_during(call) -> int:
    """Iterations a pure-Python loop in another thread ran while `call` ran REPEATS times."""
    call()  # warm up: thread pools, first-touch pages
    progress, running = [0], [True]

    def count() -> None:
        while running[0]:
            progress[0] += 1

    counter = threading.Thread(target=count, daemon=True)
    read = functools.partial(operator.getitem, progress, 0)
    bracket = [read, *[call] * REPEATS, read]
    gc_was_enabled = gc.isenabled()
    gc.disable()  # a collection could run a Python finalizer between the readings
    counter.start()
    try:
        while progress[0] == 0:  # the counter is in its loop before the first reading
            time.sleep(0.001)
        deadline, seen = time.monotonic() + DEADLINE_SECONDS, 0
        while seen == 0 and time.monotonic() < deadline:
            readings = list(map(operator.call, bracket))
            seen = readings[-1] - readings[0]
    finally:
        running[0] = False
        counter.join()
        if gc_was_enabled:
            gc.enable()
    return seen


@pytest.fixture(scope="module")
def gil_free_calls() -> dict:
    """One small call per op that releases the GIL, by name: partials, so no bytecode runs."""
    torch.manual_seed(11)
    bf = torch.bfloat16
    x4, weight = torch.randn(4, 512, dtype=bf), torch.randn(1024, 512, dtype=bf)
    rows, residual = torch.randn(64, 512, dtype=bf), torch.randn(64, 512, dtype=bf)
    q4_1 = GGMLQuantizationType.Q4_1  # a GGUF weight's blocks, as gguf-py quantizes them
    floats = np.random.default_rng(12).standard_normal((256, 512), dtype=np.float32)
    blocks = torch.from_numpy(quants.quantize(floats, q4_1)).flatten()
    angles = torch.rand(128, 64) * 6.3
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    qkv, positions = torch.randn(64, 6 * 64, dtype=bf), torch.randint(0, 128, (64,))
    cache = torch.randn(2, 64 * 16, 2, 64, dtype=bf)  # key, value: 64 blocks of 16 slots
    query, block_tables = torch.randn(16, 8, 64, dtype=bf), torch.randperm(64).repeat(16, 1)
    context_lens = torch.full((16,), 1000)
    # The in-place ops write copies, so the other ops' inputs never drift, however many calls.
    normed, rotated, written = rows.clone(), qkv.clone(), torch.zeros_like(cache)
    logits, sample_rows = torch.randn(64, 49152, dtype=bf), torch.arange(64)
    temperature, uniforms = torch.full((64,), 0.8), torch.rand(64, dtype=torch.float64)
    ops = {
        "small_batch_linear": (x4, weight, None),
        "tile_small_linear": (x4, kernels.amx_pack_weight(weight), None),
        "vector_linear": (rows, kernels.amx_pack_weight(weight), None),
        "amx_pack_weight": (weight,),
        "gguf_linear": (x4, blocks, int(q4_1), 256),
        "argmax_rows": (rows,),
        "rms_norm": (rows, weight[0], 1e-5),
        "add_rms_norm_": (normed, residual, weight[0], 1e-5),
        "rms_norm_heads_": (normed, 0, weight[0, :64], 8, 1e-5),
        "silu_and_mul": (rows,),
        "rotary_": (rotated, positions, cos, sin, 5, 64),
        "store_kv_": (qkv[:, :128], qkv[:, 128:256], *written, torch.arange(64) * 7),
        "paged_decode_attention": (query, *cache, block_tables, context_lens, 16, 0.125),
        "top_candidates": (logits, sample_rows, temperature, 64),
        "draw_whole": (logits, sample_rows, temperature, temperature * 0, uniforms),
    }
    one_group = torch.tensor([[0, 0, rows.shape[0]]])
    ops["vector_grouped_linear"] = (rows, kernels.amx_pack_weight(weight).unsqueeze(0), one_group)
    picks, route_weights = torch.zeros(64, 1, dtype=torch.int64), torch.ones(64, 1)
    ops["moe_experts"] = (
        rows,
        picks,
        route_weights,
        *_experts_layout([weight], [weight[:512, :512]]),
    )
    if kernels.amx_available():
        ops["amx_linear"] = (rows, kernels.amx_pack_weight(weight), None)
        experts = kernels.amx_pack_weight(weight).unsqueeze(0)
        padded = torch.cat([rows, rows[:32]])
        ops["amx_grouped_linear"] = (padded, experts, one_group)
    return {name: functools.partial(getattr(kernels, name), *args) for name, args in ops.items()}


GIL_FREE_OPS = [
    "small_batch_linear",
    "tile_small_linear",
    "vector_linear",
    "gguf_linear",
    "argmax_rows",
    "rms_norm",
    "add_rms_norm_",
    "rms_norm_heads_",
    "silu_and_mul",
    "rotary_",
    "store_kv_",
    "paged_decode_attention",
    "top_candidates",
    "draw_whole",
    "amx_pack_weight",
    "amx_linear",
    "amx_grouped_linear",
    "vector_grouped_linear",
    "moe_experts",
]


@pytest.mark.parametrize("name", GIL_FREE_OPS)
def test_op_releases_the_gil_while_it_computes(gil_free_calls, name) -> None:
    if name not in gil_free_calls:
        pytest.skip("no AMX on this CPU")
    assert _python_progress_during(gil_free_calls[name]) > 0


def test_a_call_that_keeps_the_gil_shows_no_progress() -> None:
    """The control: the same measurement around a C builtin that keeps the GIL reads 0."""
    assert _python_progress_during(functools.partial(sum, range(200_000))) == 0


def test_ops_give_the_same_results_from_two_threads_at_once(gil_free_calls) -> None:
    """Without the GIL two threads may run kernels together: no op keeps shared state."""
    calls = gil_free_calls
    pure = [
        "small_batch_linear",
        "tile_small_linear",
        "vector_linear",
        "gguf_linear",
        "argmax_rows",
        "paged_decode_attention",
    ]
    want = {name: calls[name]() for name in pure}
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name in pure:
            for got in pool.map(operator.call, [calls[name]] * 8):
                assert torch.equal(got, want[name])
