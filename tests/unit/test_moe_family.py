"""Mixture-of-experts families (Qwen3-MoE, Mixtral): tiny random-weight checkpoints served
through the engine, greedy output equal to Hugging Face `generate` token for token.

As tests/unit/test_model_families.py (whose tokenizer, prompts and HF greedy helper this
reuses): weights drawn wide enough that logits are far from ties, HF's greedy margin checked
at every step. The routers are checked to pick every expert of every MoE layer over the
prompts, so each expert's weights are exercised. Checkpoints: as transformers 5's
save_pretrained writes them, and rewritten to the two layouts found on disk: one tensor per
expert and matrix under the published names (Qwen3-MoE's mlp.experts.N.gate_proj, Mixtral's
block_sparse_moe.experts.N.w1/w2/w3), and transformers 5's fused [E, 2I, H] / [E, H, I].
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import (
    EOS,
    MAX_NEW_TOKENS,
    VOCAB,
    assert_stack_equals_layer_loop,
    save_random_model,
)
from tiny_models import hf_greedy as _hf_greedy
from tiny_models import prompts as _prompts
from transformers import AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig

from engine.kernels import load_cpu_kernels
from engine.llm import LLM
from engine.meter.cost_model import ChunkWork, ModelShape
from engine.models.layer_ops import make_layer_ops
from engine.models.llama import LlamaShape
from engine.models.moe import SparseMoE, moe_layer_indices
from engine.models.packed_linear import PackedLinear
from scheduler.sampling_params import SamplingParams

NUM_EXPERTS, TOP_K, EXPERT_SIZE = 8, 2, 32
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_experts_per_tok": TOP_K,
    "max_position_embeddings": 128,
    "eos_token_id": EOS,
    "bos_token_id": 0,
    "pad_token_id": 0,
}
FAMILIES = {
    # Layer 1 is dense (intermediate_size 96); top-k weights renormalized; tied head.
    "qwen3_moe-dense-layer": lambda: Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=NUM_EXPERTS,
        mlp_only_layers=[1],
        norm_topk_prob=True,
        tie_word_embeddings=True,
    ),
    # Every layer sparse; top-k weights as the softmax gave them; untied head.
    "qwen3_moe": lambda: Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        head_dim=16,
        intermediate_size=96,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=NUM_EXPERTS,
        norm_topk_prob=False,
        tie_word_embeddings=False,
    ),
    "mixtral": lambda: MixtralConfig(
        **COMMON,
        num_hidden_layers=2,
        intermediate_size=EXPERT_SIZE,
        num_local_experts=NUM_EXPERTS,
        tie_word_embeddings=False,
    ),
}
SERVING = {"block_size": 4, "kv_cache_bytes": 1 << 20, "max_num_batched_tokens": 16}


def _build_model(family: str, path: Path):
    return save_random_model(FAMILIES[family](), path)


def _rewrite(model, path: Path, layout: str) -> None:
    """Replace the checkpoint's tensors with the model's in `layout`: "fused" (transformers
    5's in-memory names) or "per_expert" (the published checkpoints' names)."""
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if layout == "per_expert":
        mixtral = model.config.model_type == "mixtral"
        block, (gate, up, down) = (
            ("block_sparse_moe", ("w1", "w3", "w2")) if mixtral else ("mlp", PER_EXPERT)
        )
        for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
            layer = name.removesuffix("mlp.experts.gate_up_proj")
            gate_up, proj = state.pop(name), state.pop(f"{layer}mlp.experts.down_proj")
            for e in range(NUM_EXPERTS):
                first = f"{layer}{block}.experts.{e}."
                state[f"{first}{gate}.weight"] = gate_up[e, :EXPERT_SIZE].contiguous()
                state[f"{first}{up}.weight"] = gate_up[e, EXPERT_SIZE:].contiguous()
                state[f"{first}{down}.weight"] = proj[e].contiguous()
            state[f"{layer}{block}.gate.weight"] = state.pop(f"{layer}mlp.gate.weight")
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    for file in path.glob("*.safetensors*"):
        file.unlink()
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})


PER_EXPERT = ("gate_proj", "up_proj", "down_proj")


def _routed_experts(model, prompts: list[list[int]]) -> dict[int, set[int]]:
    """Per MoE layer, the experts HF's router picked over the prompts' forward passes."""
    picked: dict[int, set[int]] = {}
    hooks = []
    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and type(module).__name__.endswith("TopKRouter"):
            layer = int(name.split(".")[2])

            def record(module, args, output, layer=layer):
                picked.setdefault(layer, set()).update(output[2].flatten().tolist())

            hooks.append(module.register_forward_hook(record))
    try:
        with torch.no_grad():
            for prompt in prompts:
                model(torch.tensor([prompt]))
    finally:
        for hook in hooks:
            hook.remove()
    return picked


def _llm(path: Path, dtype: str, cpu_kernels: bool) -> LLM:
    return LLM(
        model=str(path),
        dtype=dtype,
        attention_backend="auto" if cpu_kernels else "batched",
        cpu_kernels=cpu_kernels,
        **SERVING,
    )


GREEDY = SamplingParams(max_tokens=MAX_NEW_TOKENS, temperature=0.0)


@pytest.mark.parametrize("cpu_kernels", [True, False], ids=["kernels", "plain-torch"])
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_tiny_moe_greedy_equals_hugging_face(family: str, cpu_kernels: bool, tmp_path) -> None:
    model = _build_model(family, tmp_path)
    prompts = _prompts()
    expected = []
    for prompt in prompts:
        tokens, margin = _hf_greedy(model, prompt)
        assert margin > 1e-3, f"{family}: HF's greedy path has a near-tie; pick another seed"
        expected.append(tokens)
    # Every expert of every MoE layer serves some token of the prompts and continuations.
    sequences = [p + t for p, t in zip(prompts, expected, strict=True)]
    every = {i: set(range(NUM_EXPERTS)) for i in moe_layer_indices(model.config)}
    assert _routed_experts(model, sequences) == every
    llm = _llm(tmp_path, "float32", cpu_kernels)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected
    runner = llm.engine.runner
    assert runner.num_params == sum(p.numel() for p in model.parameters())
    if cpu_kernels:  # each request alone: the same tokens as in the batch
        alone = [llm.generate([prompt], GREEDY)[0].token_ids for prompt in prompts]
        assert alone == expected
    llm.engine.check_invariants()
    assert llm.engine.num_free_blocks == llm.engine.kv_cache_info.num_blocks


@pytest.mark.parametrize("layout", ["fused", "per_expert"])
@pytest.mark.parametrize("family", ["qwen3_moe-dense-layer", "mixtral"])
def test_both_expert_layouts_on_disk_load(family: str, layout: str, tmp_path) -> None:
    model = _build_model(family, tmp_path)
    _rewrite(model, tmp_path, layout)
    prompts = _prompts()
    expected = [_hf_greedy(model, prompt)[0] for prompt in prompts]
    outputs = _llm(tmp_path, "float32", cpu_kernels=False).generate(prompts, GREEDY)
    assert [o.token_ids for o in outputs] == expected


# A bf16 divergence must be one HF itself nearly took: HF's log-probability of its own token
# exceeds ours by less than this at the first position where the tokens differ. These models'
# logits stay below 5.4 in magnitude (measured), where bf16's spacing is 1/32: 0.25 is 8 ulps,
# the room two valid bf16 computations need (other summation orders, a router's near-tie).
NEAR_TIE_NATS = 0.25


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_bf16_greedy_leaves_hugging_face_only_at_near_ties(family: str, tmp_path) -> None:
    if load_cpu_kernels() is None:
        pytest.skip("native CPU kernels not available")
    model = _build_model(family, tmp_path).to(torch.bfloat16)
    prompts = _prompts()
    llm = _llm(tmp_path, "bfloat16", cpu_kernels=True)
    outputs = llm.generate(prompts, GREEDY)
    # The experts run natively (moe_experts) in bf16 on every CPU with the kernels, in the
    # tile layout (amx_grouped_linear's on an AMX CPU, else vector_grouped_linear's).
    blocks = _moe_blocks(llm)
    assert all(m.kernels is not None and m.tiled for m in blocks)
    equal = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=MAX_NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        hf = out.sequences[0, len(prompt) :].tolist()
        ours = output.token_ids
        diverged = next((i for i, (a, b) in enumerate(zip(ours, hf)) if a != b), None)
        if diverged is None:
            assert len(ours) == len(hf)
            equal += 1
            continue
        logprobs = torch.log_softmax(out.logits[diverged][0].float(), dim=-1)
        gap = float(logprobs[hf[diverged]] - logprobs[ours[diverged]])
        assert gap < NEAR_TIE_NATS, f"left HF's path at {diverged} by {gap:.3f} nats"
    # Measured: 11 of the 12 sequences equal through the end (Mixtral's other one leaves at an
    # exact tie of HF's bf16 logits).
    assert equal >= len(prompts) // 2


# Experts of the decode stack's checkpoints: a router of 8 (NUM_EXPERTS) outputs is not a tiled
# shape, so without AMX (where PackedLinear keeps no row-major copy) it has no small-batch
# kernel and such a model keeps the layer loop; 32 tile.
STACK_EXPERTS = 32


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_moe_decode_stack_equals_its_layer_loop(family: str, tmp_path) -> None:
    """bf16 with the kernels: a MoE layer's router, moe_route and moe_experts run inside the
    native decode stack as in the layer loop, so greedy and seeded sampled requests give the
    same tokens and logprobs, bit for bit, with the stack and with it detached, and the meter
    reads the same experts run at every step. Each family's routing (renormalized or not,
    rounded to bf16 or not) and a dense layer among sparse ones, with STACK_EXPERTS experts."""
    config = FAMILIES[family]()
    setattr(config, "num_local_experts" if family == "mixtral" else "num_experts", STACK_EXPERTS)
    model = save_random_model(config, tmp_path)
    # No prefix caching: the second run must prefill as the first did. (A cached prefix leaves
    # fewer prompt rows to prefill, so experts get other group sizes; the grouped products of
    # 1-2 rows may differ in the last bit from larger groups', as the dense kernels' do.)
    llm = LLM(model=str(tmp_path), dtype="bfloat16", enable_prefix_caching=False, **SERVING)
    with_stack_runs, experts_run = assert_stack_equals_layer_loop(
        llm, _prompts()[:3], lambda r: r.num_experts_run
    )
    assert with_stack_runs == experts_run
    # Each step ran at least top-k experts in every MoE layer, at most all of them.
    moe_layers = len(moe_layer_indices(model.config))
    assert all(moe_layers * TOP_K <= n <= moe_layers * STACK_EXPERTS for n in experts_run)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantization_keeps_the_routers_in_bf16(quantization: str, tmp_path) -> None:
    """--quantization int8/int4 on a MoE checkpoint quantizes the attention linears and leaves
    each router in bf16 (its logits pick the experts), as the LM head; the model serves. The
    routers are STACK_EXPERTS wide, a shape both quantizers would otherwise take."""
    if load_cpu_kernels() is None:
        pytest.skip("native CPU kernels not available")
    config = FAMILIES["qwen3_moe"]()
    config.num_experts = STACK_EXPERTS
    save_random_model(config, tmp_path)
    llm = LLM(
        model=str(tmp_path),
        dtype="bfloat16",
        quantization=quantization,
        int8_smoothing=False,
        **SERVING,
    )
    runner = llm.engine.runner
    assert all(isinstance(m.gate, PackedLinear) for m in _moe_blocks(llm))
    quantized = runner.num_int8_layers + runner.num_int4_layers
    assert quantized == 2 * config.num_hidden_layers  # qkv and o a layer
    out = llm.generate(_prompts()[:2], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]


def _moe_blocks(llm: LLM) -> list[SparseMoE]:
    return [m for m in llm.engine.runner.model.modules() if isinstance(m, SparseMoE)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_meter_reads_the_experts_a_step_ran(family: str, tmp_path) -> None:
    """A prefill step's distinct experts (from HF's router on the same tokens) reach the cost
    model; FLOPs count the active parameters."""
    model = _build_model(family, tmp_path)
    # 8 tokens: one prefill chunk (the 16-token budget's long-prefill threshold is 8).
    prompt = _prompts()[2][:8]
    run = sum(len(picked) for picked in _routed_experts(model, [prompt]).values())
    llm = _llm(tmp_path, "float32", cpu_kernels=False)
    engine = llm.engine
    engine.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0.0))
    stats = engine.step().stats
    assert engine.runner.num_experts_run == run
    chunk = ChunkWork(len(prompt), len(prompt), samples=True, is_decode=False)
    cost = engine.meter.cost_model.step_cost([chunk], run)
    assert stats.prefill_bytes == cost.total_bytes
    assert stats.prefill_flops == cost.total_flops
    shape, weights = engine.model_shape, engine.meter.cost_model.weight_bytes
    expert = 3 * shape.hidden_size * EXPERT_SIZE
    assert weights.expert == expert * 4  # float32
    # The modelled bound, for a step whose count is unknown: every pick a new expert.
    modelled = engine.meter.cost_model.step_cost([chunk]).total_bytes
    assert modelled - cost.total_bytes == (shape.num_moe_layers * NUM_EXPERTS - run) * expert * 4
    moe_layers = len(moe_layer_indices(model.config))
    idle = moe_layers * (NUM_EXPERTS - TOP_K) * expert
    assert shape.num_params == sum(p.numel() for p in model.parameters())
    assert shape.num_active_params == shape.num_params - idle


def test_moe_layers_follow_transformers() -> None:
    """Which layers are sparse: our model shape, the cost model's shape and transformers'."""
    config = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=6,
        moe_intermediate_size=EXPERT_SIZE,
        num_experts=NUM_EXPERTS,
        mlp_only_layers=[3],
        decoder_sparse_step=2,
    )
    model = AutoModelForCausalLM.from_config(config)
    hf = {i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts")}
    assert hf == {1, 5}
    shape = LlamaShape.from_config(config)
    assert shape.moe_layers == hf and shape.qk_norm and not shape.norm_topk_prob
    assert ModelShape.from_hf_config(config, 2).num_moe_layers == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_sparse_moe_matches_the_hugging_face_block(family: str, dtype: torch.dtype) -> None:
    """One MoE block on 40 tokens against HF's default (grouped_mm) one, plain torch and with
    the kernels (in bf16: moe_experts, over AMX tiles or, without AMX, row-major experts).
    bf16 is bit-identical: the same roundings in the same places (Mixtral's eager HF path,
    which rounds each expert's weighted output before adding, is not; at these 64 inputs per
    product the fp32 summation order never moved a bf16 rounding, here or on AMX); float32
    within 1e-5."""
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(FAMILIES[family](), dtype=dtype).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.15)
    block = model.model.layers[0].mlp
    shape = LlamaShape.from_config(model.config)
    x = torch.randn(40, shape.hidden_size, dtype=dtype)
    with torch.no_grad():
        want = block(x[None])[0]
        picked = set(block.gate(x)[2].flatten().tolist())
    kernels = load_cpu_kernels()
    for ops_kernels in (None, kernels) if kernels is not None else (None,):
        ours = _sparse_moe(shape, block, make_layer_ops(ops_kernels), dtype)
        got = ours.forward(x)
        assert ours.num_experts_run == len(picked)
        if dtype == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            # float32 is close, not equal: the kernels' silu differs from torch's in the last
            # bit, and HF's grouped_mm may sum in another order than torch's per-expert mm (it
            # did on an AVX2-only EPYC, and on a Zen 4 EPYC in one run of two, plain torch).
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def _sparse_moe(shape: LlamaShape, block, ops, dtype: torch.dtype) -> SparseMoE:
    with torch.device("meta"):
        moe = SparseMoE(shape, ops)
    moe.gate.weight = torch.nn.Parameter(block.gate.weight.detach().clone(), requires_grad=False)
    moe.allocate(dtype)
    gate_up, down = block.experts.gate_up_proj.detach(), block.experts.down_proj.detach()
    for e in range(shape.num_experts):
        moe.load_expert(e, gate_up[e, :EXPERT_SIZE], gate_up[e, EXPERT_SIZE:], down[e])
    return moe
