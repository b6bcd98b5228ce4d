"""The native DecodeStack against the per-layer Python path it replaces, on the served model.

The engine serves the embedded SmolLM2 Q4_1 GGUF in bfloat16, as the server does. Every
decode-only step of 1 to the stack's row limit (8; 32 on an AMX CPU, where 5-32 rows take the
GGUF tiles) runs twice: first through the Python layer loop (LlamaForCausalLM.forward with the
stack detached, its linears held to the small-batch kernels up to the stack's row limit), then
through the stack. The stack makes the same kernel calls in the same order, so both must give
bit-identical hidden states and write bit-identical keys and values (the second run overwrites
the first's slots with its own). As many requests as the limit, of different lengths, leave one
by one, so steps of every size from the limit to 1 occur, with contexts that cross block
boundaries; sampled and greedy rows mix. Both with the exact weights and with int8 inputs
(gguf_activations "int8").
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.kernels import load_cpu_kernels
from engine.llm import LLM
from engine.models import packed_linear
from engine.models.decode_stack import build_decode_stack
from scheduler.sampling_params import SamplingParams


@pytest.fixture(scope="module", params=["exact", "int8"])
def served_llm(request):
    """Both gguf_activations: with "int8" the stack's GGUF parts carry the flag into
    gguf_small_linear, as GGUFLinear passes it to kernels.gguf_linear."""
    if load_cpu_kernels() is None:  # and bf16 int8 inputs are refused without them
        pytest.skip("the native kernels are not built on this machine")
    llm = LLM(EngineConfig(dtype="bfloat16", gguf_activations=request.param))
    if llm.engine.runner.model.decode_stack is None:
        pytest.skip("the native kernels are not built on this machine")
    return llm


class BothWays:
    """Wraps the model's forward: small decode steps run on both paths and are compared."""

    def __init__(self, model) -> None:
        self.model, self.stack, self.forward = model, model.decode_stack, model.forward
        self.rows_checked: set[int] = set()
        self.steps = 0

    def __call__(self, input_ids, positions, kv_cache, meta):
        if not self.stack.takes(meta, input_ids.shape[0], kv_cache):
            return self.forward(input_ids, positions, kv_cache, meta)
        # The Python loop with the stack's kernels: single linear calls take the small-batch
        # kernels up to the stack's row limit too (above 4 rows they are only used inside it).
        self.model.decode_stack, limit = None, packed_linear.SMALL_BATCH_ROWS
        packed_linear.SMALL_BATCH_ROWS = self.stack.max_rows
        try:
            reference = self.forward(input_ids, positions, kv_cache, meta)
        finally:
            packed_linear.SMALL_BATCH_ROWS = limit
        reference_kv = _written(kv_cache, meta.slot_mapping)
        self.model.decode_stack = self.stack
        fused = self.forward(input_ids, positions, kv_cache, meta)
        assert torch.equal(fused, reference), "hidden states differ"
        for ours, theirs in zip(_written(kv_cache, meta.slot_mapping), reference_kv, strict=True):
            assert torch.equal(ours, theirs), "cached keys/values differ"
        self.rows_checked.add(input_ids.shape[0])
        self.steps += 1
        return fused


def _written(kv_cache, slots) -> list[torch.Tensor]:
    return [cache[slots].clone() for cache in (*kv_cache.keys, *kv_cache.values)]


def test_stack_equals_the_layer_loop(served_llm) -> None:
    model = served_llm.engine.runner.model
    checker = BothWays(model)
    model.forward = checker
    try:
        rows = checker.stack.max_rows
        lengths = (5, 16, 31, 47, 9, 22, 64, 3, 12, 40, 7, 27, 18, 35, 11, 50,
                   14, 6, 33, 20, 58, 8, 25, 41, 4, 17, 29, 52, 10, 36, 2, 44)[:rows]  # fmt: skip
        prompts = [list(range(100 + i, 100 + i + n)) for i, n in enumerate(lengths)]
        # All different: `rows` rows, then one fewer, ..., 1.
        max_tokens = (20, 12, 28, 6, 9, 15, 24, 3, 30, 4, 17, 26, 8, 22, 13, 33,
                      35, 2, 19, 31, 10, 27, 5, 36, 14, 23, 7, 34, 18, 11, 29, 21)[:rows]  # fmt: skip
        params = [
            SamplingParams(max_tokens=n, ignore_eos=True, temperature=0, seed=i)
            if i % 2
            else SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, top_p=0.9, seed=i)
            for i, n in enumerate(max_tokens)
        ]
        outputs = served_llm.generate(prompts, params)
    finally:
        del model.forward  # the instance attribute; the class's forward again
    assert [len(o.token_ids) for o in outputs] == list(max_tokens)
    assert checker.stack.max_rows == (32 if served_llm.engine.runner.kernels.amx_available() else 8)
    assert checker.rows_checked == set(range(1, rows + 1))
    # All the prompts prefill in one step; every step after it is a decode-only step.
    assert checker.steps == max(len(o.token_ids) for o in outputs) - 1


def test_stack_checks_its_inputs(served_llm) -> None:
    stack = served_llm.engine.runner.model.decode_stack
    hidden = torch.zeros(1, served_llm.engine.runner.shape.hidden_size, dtype=torch.bfloat16)
    one = torch.zeros(1, dtype=torch.long)
    tables = torch.zeros(1, 1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="slot"):
        stack.native.run(hidden, one, torch.tensor([10**9]), tables, one + 1)
    with pytest.raises(RuntimeError, match="hidden"):
        stack.native.run(hidden[:, :8], one, one, tables, one + 1)


def test_no_stack_without_kernels(served_llm) -> None:
    runner = served_llm.engine.runner
    assert build_decode_stack(runner.model, runner.kv_cache, None) is None
