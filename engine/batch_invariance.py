"""Batch invariance (`--batch-invariant`): a request's logits, and so a greedy or seeded
request's tokens, do not depend on what else runs in its steps.

By default the kernels round differently at different row counts: a GGUF linear reads its exact
blocks for 1-4 rows and bf16-rounded panels (or a bf16 copy) above; a bf16 linear on AMX takes
AVX512-BF16 dot products for 1-4 rows and tile products above; the decode stack runs the
1-8-row kernels; prompt chunks attend with a prefill kernel whose sums run in another order
than a decode's. Here each piece keeps one arithmetic per row whatever the batch (vLLM's
batch-invariant mode does the same on GPUs):
- GGUF linears run every row count on the block panels (weights dequantized to bf16 per panel,
  AMX tiles or AVX512-BF16 dot products: what larger batches take by default), whose per-row
  sums do not depend on the other rows (on AMX, up to 64 rows take gguf_tiles.cpp's kernel,
  which gives a row the panels' sums bit for bit, faster); no bf16 copy is built;
- bf16 linears run on the tiles' large-batch product at every row count (amx_linear on AMX,
  vector_linear elsewhere: each a row's sums in one order), for the same reason;
- int8 linears need nothing: their rows are independent on every path (int8_linear.py);
- attention runs every row, prompt rows included, through the decode kernel (each row its own
  one-token span, engine/forward_batch.py's rows_as_decodes), so a prompt chunk of any length,
  a recompute after preemption and a decode all attend alike;
- there is no decode stack (its small-batch kernels round unlike the paths above).
Norms, RoPE, activations and the sampler are per row already; a seeded request draws from its
own generator (engine/sampler.py). tests/unit/test_batch_invariance.py holds each piece to it.

What it costs (docs/benchmarks.md): few-row steps lose their matvec kernels and the decode
stack (one stream of the embedded model ≈ 0.55× the default on an AMX CPU), batches lose the bf16 copy
(≈ 0.85× at 32 streams), and prompts attend row by row. Where a piece has no batch-invariant
path (float32, no native kernels, a bf16 layer whose sizes are not multiples of 32,
mixture-of-experts layers, a GGUF file with float linear weights) the engine refuses to start
and says which.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.models.gguf_linear import GGUFLinear
from engine.models.int8_linear import Int8Linear
from engine.models.moe import SparseMoE
from engine.models.packed_linear import PackedLinear


class BatchInvarianceError(ValueError):
    """The model has a piece without a batch-invariant path; the message names it."""


def check_supported(dtype: torch.dtype, kernels, attention_backend: str) -> None:
    """Refuse what the mode cannot run before the model loads."""
    if kernels is None:
        raise BatchInvarianceError("--batch-invariant needs the native CPU kernels")
    if dtype != torch.bfloat16:
        raise BatchInvarianceError(f"--batch-invariant runs bfloat16 models only, not {dtype}")
    if attention_backend not in ("auto", "cpu_kernels"):
        raise BatchInvarianceError(
            f"--batch-invariant attends with the native kernels, not {attention_backend!r}"
        )


def make_batch_invariant(model: nn.Module) -> None:
    """Put every linear of a loaded, prepared model on its batch-invariant path. Raises
    BatchInvarianceError naming the first layer that has no such path."""
    for name, module in list(model.named_modules()):
        if isinstance(module, SparseMoE):
            raise BatchInvarianceError(
                f"--batch-invariant: mixture-of-experts layer {name} groups tokens by expert, "
                "and a group's kernel depends on its size"
            )
        if isinstance(module, GGUFLinear):
            _gguf(name, module)
        elif isinstance(module, PackedLinear):
            _packed(name, module)
        elif isinstance(module, nn.Linear):
            raise BatchInvarianceError(
                f"--batch-invariant: layer {name} is a plain torch linear (no packed layout)"
            )
        elif not isinstance(module, Int8Linear) and _is_linear_like(module):
            raise BatchInvarianceError(f"--batch-invariant: layer {name} has no invariant path")


def _gguf(name: str, linear: GGUFLinear) -> None:
    if linear.kernels is None or any(isinstance(p, torch.Tensor) for p in linear.parts):
        raise BatchInvarianceError(
            f"--batch-invariant: GGUF layer {name} is not read from its blocks by the kernels"
        )
    if linear.large is not None:  # the runner builds no bf16 copy in this mode: it rounds
        raise BatchInvarianceError(f"--batch-invariant: GGUF layer {name} has a bf16 copy")
    linear.panels_only = True


def _packed(name: str, linear: PackedLinear) -> None:
    if linear.tiles is None:
        raise BatchInvarianceError(
            f"--batch-invariant: bf16 layer {name} is not in the tile layout (its sizes must "
            "be multiples of 32, read by the native kernels)"
        )
    linear.tiles_only = True


def _is_linear_like(module: nn.Module) -> bool:
    return hasattr(module, "out_features") and hasattr(module, "in_features")
