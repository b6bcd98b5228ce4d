"""The batch-invariant mode's pieces (engine/batch_invariance.py), each held to its promise: a
row's result is bit for bit what it is when that row runs alone.

- a GGUFLinear on the block panels (panels_only): every served block format, AMX tiles and
  AVX512-BF16 dot products, each row equal to the row of a 64-row call at 1, 3, 5, 20, 32
  and 33 rows, and close to the plain-torch product of the dequantized weights;
- paged_decode_attention: a row's output does not depend on the other rows of the call;
- build_lists' rows_as_decodes: prompt rows attend as decodes of their own (equal to a
  one-row decode call), and the step agrees with ReferenceAttention over the same chunks;
- PackedLinear.tiles_only: every row count on the tiles (amx_linear on AMX, vector_linear
  elsewhere), rows independent;
- what the mode cannot run is refused, naming the reason.
The engine end to end (a seeded request alone and inside mixed batches) is
tests/integration_engine/test_batch_invariance_engine.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from engine import batch_invariance
from engine.attention.cpu_kernel import CpuKernelAttention
from engine.attention.reference import ReferenceAttention
from engine.batch_invariance import BatchInvarianceError
from engine.forward_batch import build_lists, to_tensors
from engine.gguf_blocks import dequantize
from engine.gguf_tensors import GGUFBlocks
from engine.kernels import load_cpu_kernels
from engine.models.gguf_linear import GGUFLinear
from engine.models.packed_linear import PackedLinear, packing_available
from scheduler.output import ScheduledChunk
from scheduler.sampling_params import SamplingParams
from tests.unit.gguf_block_samples import KINDS, make_blocks

try:
    KERNELS = load_cpu_kernels()
except Exception:  # noqa: BLE001 - no compiler or no AVX512-BF16: nothing native to test
    KERNELS = None
needs_kernels = pytest.mark.skipif(KERNELS is None, reason="native kernels not built here")

BLOCK_SIZE = 16


@needs_kernels
@pytest.mark.parametrize("kind", KINDS)
def test_gguf_panels_give_each_row_the_same_sums_at_every_row_count(kind) -> None:
    rows, cols = 64, 512
    blocks = make_blocks(kind, rows, cols, seed=kind)
    linear = GGUFLinear([GGUFBlocks(kind, blocks, cols)], cols, None, torch.bfloat16)
    linear.use_kernels(KERNELS)
    linear.panels_only = True
    x = torch.randn(64, cols, generator=torch.Generator().manual_seed(kind)).bfloat16()
    full = linear(x)
    # Up to 32 rows the tiles (20: a second x tile, half full), above the panels.
    for count in (1, 3, 5, 20, 32, 33):
        assert torch.equal(linear(x[:count]), full[:count]), count
    # The AVX512-BF16 panels (what a CPU without AMX takes) keep rows independent too.
    vector = KERNELS.gguf_linear(x, blocks, kind, rows, use_amx=False, small_rows=0)
    for count in (1, 3, 5, 33):
        part = x[:count].contiguous()
        assert torch.equal(
            KERNELS.gguf_linear(part, blocks, kind, rows, use_amx=False, small_rows=0),
            vector[:count],
        )
    # bf16-rounded weights and outputs: within 1 % of the outputs' scale.
    reference = x.float() @ dequantize(kind, blocks, cols).float().T
    assert (full.float() - reference).abs().max() <= 1e-2 * reference.abs().max()


def _paged_cache(num_blocks: int, kv_heads: int, dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    shape = (num_blocks * BLOCK_SIZE, kv_heads, dim)
    return torch.randn(shape, generator=g).bfloat16(), torch.randn(shape, generator=g).bfloat16()


@needs_kernels
def test_decode_attention_rows_do_not_depend_on_the_other_rows() -> None:
    heads, kv_heads, dim = 9, 3, 64
    keys, values = _paged_cache(160, kv_heads, dim, seed=1)
    context_lens = torch.tensor([1, 17, 200, 64, 5, 130, 33, 250], dtype=torch.int64)
    tables = torch.randperm(160, generator=torch.Generator().manual_seed(2))[:128].reshape(8, 16)
    query = torch.randn(8, heads, dim, generator=torch.Generator().manual_seed(3)).bfloat16()
    scale = dim**-0.5
    together = KERNELS.paged_decode_attention(
        query, keys, values, tables, context_lens, BLOCK_SIZE, scale
    )
    for i in range(8):
        alone = KERNELS.paged_decode_attention(
            query[i : i + 1].contiguous(),
            keys,
            values,
            tables[i : i + 1].contiguous(),
            context_lens[i : i + 1].contiguous(),
            BLOCK_SIZE,
            scale,
        )
        assert torch.equal(together[i], alone[0]), i


def _mixed_step(heads: int, kv_heads: int, dim: int, rows_as_decodes: bool):
    """Two decodes (contexts 40 and 9) then two prompt chunks: 20 new tokens after 12 cached,
    and a whole 7-token prompt. Returns q/k/v for the 29 new rows and the step's metadata."""
    shapes = [("a", 39, 1, [3, 4, 5]), ("b", 8, 1, [6]), ("c", 12, 20, [7, 8]), ("d", 0, 7, [9])]
    chunks = [
        ScheduledChunk(
            request_id=request_id,
            token_ids=[1] * query_len,
            start_position=start,
            block_table=table,
            samples=True,
            num_prompt_tokens=start + query_len,
            sampling_params=SamplingParams(temperature=0.0),
            prompt_token_ids=[],
            output_token_ids=[],
        )
        for request_id, start, query_len, table in shapes
    ]
    meta = to_tensors(build_lists(chunks, BLOCK_SIZE, rows_as_decodes), BLOCK_SIZE).meta
    g = torch.Generator().manual_seed(4)
    query = torch.randn(29, heads, dim, generator=g).bfloat16()
    key = torch.randn(29, kv_heads, dim, generator=g).bfloat16()
    value = torch.randn(29, kv_heads, dim, generator=g).bfloat16()
    return query, key, value, meta


@needs_kernels
def test_rows_as_decodes_attend_each_prompt_row_as_a_decode_of_its_own() -> None:
    heads, kv_heads, dim = 8, 2, 64
    query, key, value, meta = _mixed_step(heads, kv_heads, dim, rows_as_decodes=True)
    assert meta.num_decodes == 29 and meta.prefill_spans is None  # every row a one-token span
    scale = dim**-0.5
    keys, values = _paged_cache(16, kv_heads, dim, seed=5)  # cached positions hold noise
    out = CpuKernelAttention(KERNELS).forward(query, key, value, keys, values, meta, scale)
    for row, span in enumerate(meta.chunks):
        alone = KERNELS.paged_decode_attention(
            query[row : row + 1].contiguous(),
            keys,
            values,
            torch.tensor([span.block_table], dtype=torch.int64),
            torch.tensor([span.context_len], dtype=torch.int64),
            BLOCK_SIZE,
            scale,
        )
        assert torch.equal(out[row], alone[0]), row
    # The same step as chunks, by the reference: the same attention, up to rounding.
    _, _, _, chunked = _mixed_step(heads, kv_heads, dim, rows_as_decodes=False)
    ref_keys, ref_values = _paged_cache(16, kv_heads, dim, seed=5)
    reference = ReferenceAttention().forward(
        query.float(), key.float(), value.float(), ref_keys.float(), ref_values.float(), chunked,
        scale,
    )  # fmt: skip
    assert torch.allclose(out.float(), reference, rtol=3e-2, atol=3e-2)


@needs_kernels
def test_tiles_only_packed_linear_rows_do_not_depend_on_the_batch() -> None:
    linear = nn.Linear(512, 256, bias=False).bfloat16()
    packed = PackedLinear(linear, KERNELS)
    packed.tiles_only = True
    x = torch.randn(64, 512).bfloat16()
    full = packed(x)
    for count in (1, 2, 3, 4, 5, 33):
        assert torch.equal(packed(x[:count]), full[:count]), count


def test_the_mode_refuses_what_it_cannot_run() -> None:
    with pytest.raises(BatchInvarianceError, match="native CPU kernels"):
        batch_invariance.check_supported(torch.bfloat16, None, "auto")
    with pytest.raises(BatchInvarianceError, match="bfloat16"):
        batch_invariance.check_supported(torch.float32, object(), "auto")
    with pytest.raises(BatchInvarianceError, match="batched"):
        batch_invariance.check_supported(torch.bfloat16, object(), "batched")
    plain = nn.Sequential(nn.Linear(64, 64))
    with pytest.raises(BatchInvarianceError, match="plain torch linear"):
        batch_invariance.make_batch_invariant(plain)
    if packing_available():  # oneDNN packs bf16 only with AVX512-BW/VL/DQ or AVX-NE-CONVERT
        onednn_only = nn.Sequential(PackedLinear(nn.Linear(64, 64, bias=False).bfloat16(), None))
        with pytest.raises(BatchInvarianceError, match="not in the tile layout"):
            batch_invariance.make_batch_invariant(onednn_only)
