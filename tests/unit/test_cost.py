"""CostModel against hand computation and against the 2N-FLOPs-per-token rule of thumb."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import LlamaConfig, Qwen3Config

from engine.meter.cost_model import ChunkWork, CostModel, ModelShape, WeightBytes

# 2 layers, hidden 8, 2 query heads and 1 KV head of dim 4, MLP 16, vocab 10, tied, 2 bytes.
TINY = ModelShape(
    num_layers=2,
    hidden_size=8,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    intermediate_size=16,
    vocab_size=10,
    num_params=1272,  # 2 * (8*16 + 8*8 + 3*8*16 + 2*8) + 8 + 10*8, hand-counted
    dtype_bytes=2,
    tie_word_embeddings=True,
)

SMOLLM2_135M = LlamaConfig(
    hidden_size=576,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    intermediate_size=1536,
    vocab_size=49152,
    tie_word_embeddings=True,
)

LLAMA2_7B = LlamaConfig(
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=32,
    intermediate_size=11008,
    vocab_size=32000,
    tie_word_embeddings=False,
)


def test_hand_computed_flops_and_bytes_of_a_mixed_step():
    # Prefill chunk: 3 new tokens at positions 2..4 (context 5), samples.
    # Decode chunk: 1 new token at position 6 (context 7), samples.
    prefill = ChunkWork(num_new_tokens=3, context_len=5, samples=True, is_decode=False)
    decode = ChunkWork(num_new_tokens=1, context_len=7, samples=True, is_decode=True)
    cost = CostModel(TINY).step_cost([prefill, decode])

    # Per token, both layers: QKV 2*8*(8+2*4) + out 2*8*8 = 384 per layer; MLP 2*3*8*16 = 768.
    dense = 2 * (384 + 768)  # 2304
    pair = 2 * 4 * 8  # scores + weighted sum, 2 FLOPs * q_dim 8 each, both layers: 64
    lm_head = 2 * 8 * 10  # 160
    # Prefill tokens attend 3, 4 and 5 positions = 12 pairs; decode attends 7.
    assert cost.chunk_flops == [3 * dense + 12 * pair + lm_head, dense + 7 * pair + lm_head]
    assert cost.chunk_flops == [7840.0, 2912.0]
    assert cost.prefill_flops == 7840.0
    assert cost.decode_flops == 2912.0

    # Weights: body (1272 - 80 embedding params) * 2 bytes = 2384, split 3:1 by tokens; LM head
    # (tied table) 80 * 2 = 160, split evenly between the two sampling chunks.
    # KV per token: K+V * 2 layers * kv_dim 4 * 2 bytes = 32. Embedding row: 8 * 2 = 16 bytes.
    prefill_bytes = 2384 * 3 / 4 + 80 + 5 * 32 + 3 * 32 + 3 * 16  # 1788 + 80 + 160 + 96 + 48
    decode_bytes = 2384 * 1 / 4 + 80 + 7 * 32 + 1 * 32 + 16  # 596 + 80 + 224 + 32 + 16
    assert cost.chunk_bytes == [prefill_bytes, decode_bytes] == [2172.0, 948.0]
    assert (cost.prefill_bytes, cost.decode_bytes) == (2172.0, 948.0)


def test_a_decode_verifying_drafts_samples_every_row_and_reads_each_rows_context():
    # Known token at position 4 and drafts at 5 and 6 (context 7): three decode rows.
    spec = ChunkWork(3, 7, samples=True, is_decode=True, num_draft_tokens=2)
    plain = ChunkWork(1, 9, samples=True, is_decode=True)
    cost = CostModel(TINY).step_cost([spec, plain])
    # Rows attend 5, 6 and 7 positions; each of the 3 rows runs the LM head (160 each).
    assert cost.chunk_flops == [3 * 2304 + 18 * 64 + 3 * 160, 2304 + 9 * 64 + 160]
    assert cost.decode_flops == sum(cost.chunk_flops) and cost.prefill_flops == 0.0
    # Body 2384 split 3:1 by tokens, head 160 split 3:1 by sampled rows; the draft rows read
    # their contexts one by one (5 + 6 + 7 positions of 32 bytes), write 3, gather 3 rows.
    spec_bytes = 2384 * 3 / 4 + 160 * 3 / 4 + 18 * 32 + 3 * 32 + 3 * 16
    plain_bytes = 2384 / 4 + 160 / 4 + 9 * 32 + 32 + 16
    assert cost.chunk_bytes == [spec_bytes, plain_bytes]


def test_batch_invariant_attention_reads_each_prompt_rows_context_on_its_own():
    # 3 prompt tokens after 4 cached: one pass reads the 7 positions once; row by row (the
    # batch-invariant mode's decode kernel) 5 + 6 + 7 positions of 32 bytes. FLOPs are equal.
    chunk = ChunkWork(3, 7, samples=True, is_decode=False)
    plain = CostModel(TINY).step_cost([chunk])
    rows = CostModel(TINY, rows_as_decodes=True).step_cost([chunk])
    assert rows.chunk_flops == plain.chunk_flops
    assert rows.chunk_bytes[0] - plain.chunk_bytes[0] == (5 + 6 + 7 - 7) * 32


def test_a_chunk_that_does_not_sample_skips_the_lm_head_and_its_weights():
    mid_prompt = ChunkWork(num_new_tokens=2, context_len=2, samples=False, is_decode=False)
    cost = CostModel(TINY).step_cost([mid_prompt])
    assert cost.chunk_flops == [2 * 2304 + 3 * 64]  # tokens attend 1 and 2 positions
    # Body weights only (2384), KV read 2 tokens, written 2, two embedding rows.
    assert cost.chunk_bytes == [2384 + 2 * 32 + 2 * 32 + 2 * 16]
    assert cost.decode_flops == 0.0 and cost.decode_bytes == 0.0


def test_an_empty_step_costs_nothing():
    cost = CostModel(TINY).step_cost([])
    assert (cost.prefill_flops, cost.decode_flops, cost.prefill_bytes, cost.decode_bytes) == (
        0.0,
        0.0,
        0.0,
        0.0,
    )
    assert cost.chunk_flops == [] and cost.chunk_bytes == []


def test_weights_are_read_once_per_step_however_many_requests_share_it():
    model = CostModel(TINY)
    one = model.step_cost([ChunkWork(1, 7, True, True)])
    four = model.step_cost([ChunkWork(1, 7, True, True)] * 4)
    kv_and_embedding = 7 * 32 + 32 + 16
    assert one.total_bytes == 2544 + kv_and_embedding
    assert four.total_bytes == 2544 + 4 * kv_and_embedding
    assert four.total_flops == 4 * one.total_flops


def test_from_hf_config_counts_smollm2_parameters_exactly():
    shape = ModelShape.from_hf_config(SMOLLM2_135M, dtype_bytes=2)
    assert shape.head_dim == 64
    assert shape.num_kv_heads == 3
    assert shape.tie_word_embeddings is True
    assert shape.num_params == 134_515_008  # what HF reports for SmolLM2-135M
    assert shape.kv_bytes_per_token == 2 * 30 * 192 * 2


def test_from_hf_config_reads_an_explicit_head_dim_and_keeps_a_given_param_count():
    config = Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,  # Qwen3 decouples head_dim from hidden / heads (= 64 here)
        intermediate_size=3072,
        vocab_size=1000,
        tie_word_embeddings=True,
    )
    shape = ModelShape.from_hf_config(config, dtype_bytes=4, num_params=123)
    assert (shape.head_dim, shape.q_dim, shape.kv_dim) == (128, 2048, 1024)
    assert shape.num_params == 123 and shape.dtype_bytes == 4


def _generate(model: CostModel, prompt: int, generated: int) -> float:
    """FLOPs of one request: one prefill step, then generated - 1 decode steps."""
    total = model.step_cost([ChunkWork(prompt, prompt, True, False)]).total_flops
    for position in range(prompt, prompt + generated - 1):
        total += model.step_cost([ChunkWork(1, position + 1, True, True)]).total_flops
    return total


def test_short_context_matches_the_2n_rule_of_thumb_within_3_percent():
    # Rule of thumb: ~2N FLOPs per token, N = parameters used in matmuls (the untied input
    # embedding is a lookup). Deviations, for P = G = 128 on a 7B shape: attention over a
    # context <= 256 adds ~0.5%; the prompt's rows skip the LM head (-1%); the last generated
    # token is never fed back (-0.4%). Together well inside 3%.
    shape = ModelShape.from_hf_config(LLAMA2_7B, dtype_bytes=2)
    assert shape.num_params == 6_738_415_616  # HF's count for Llama-2-7b
    n = shape.num_params - shape.embedding_params
    prompt, generated = 128, 128
    rule = 2 * n * (prompt + generated)
    assert _generate(CostModel(shape), prompt, generated) == pytest.approx(rule, rel=0.03)


def test_small_model_needs_the_lm_head_term_that_the_rule_of_thumb_hides():
    # SmolLM2-135M's tied LM head is 21% of N, so charging it to every prompt token (2N per
    # token) overestimates by ~10% at P = G. Counting the LM head only for sampled tokens
    # restores agreement to within 1% (the rest is attention over a <= 64-token context).
    shape = ModelShape.from_hf_config(SMOLLM2_135M, dtype_bytes=2)
    model = CostModel(shape)
    prompt, generated = 32, 32
    flops = _generate(model, prompt, generated)
    naive = 2 * shape.num_params * (prompt + generated)
    assert flops == pytest.approx(naive, rel=0.15)
    assert abs(flops - naive) / naive > 0.05  # the naive rule is visibly off here
    body = shape.num_params - shape.embedding_params
    refined = 2 * body * (prompt + generated - 1) + 2 * shape.embedding_params * generated
    assert flops == pytest.approx(refined, rel=0.01)


# A GGUF-like layout: small batches stream 4-bit blocks (a quarter of the bf16 bytes plus
# scales), larger ones bf16 matrices; the LM head runs over the sampling rows only.
GGUF_LIKE = WeightBytes(
    body_small=700, body_large=2384, head_small=50, head_large=160, embedding_row=16,
    small_batch_rows=4,
)  # fmt: skip


def test_decode_of_few_rows_counts_the_quantized_bytes_the_matvecs_read():
    decodes = [ChunkWork(1, 10, samples=True, is_decode=True) for _ in range(2)]
    cost = CostModel(TINY, GGUF_LIKE).step_cost(decodes)
    # 2 rows <= 4: body 700 and head 50 split evenly; KV read 10 * 32, written 32; one row 16.
    assert cost.chunk_bytes == [350 + 25 + 320 + 32 + 16] * 2


def test_a_long_prefill_reads_bf16_body_but_its_single_sampling_row_reads_the_small_head():
    prefill = ChunkWork(num_new_tokens=8, context_len=8, samples=True, is_decode=False)
    cost = CostModel(TINY, GGUF_LIKE).step_cost([prefill])
    # 8 rows > 4 for the body (2384 bf16), 1 sampling row <= 4 for the head (50).
    assert cost.chunk_bytes == [2384 + 50 + 8 * 32 + 8 * 32 + 8 * 16]


def test_decode_only_steps_up_to_the_stack_limit_read_the_small_body():
    """The decode stack runs decode-only steps of <= decode_stack_rows on the small layouts;
    a step of as many rows that holds a prefill chunk runs the body on the large path."""
    weights = dataclasses.replace(GGUF_LIKE, decode_stack_rows=8)
    model = CostModel(TINY, weights)
    decodes = [ChunkWork(1, 10, samples=True, is_decode=True) for _ in range(8)]
    # 8 decode rows: body 700 split 8 ways; 8 sampling rows > 4: head 160 split 8 ways.
    assert model.step_cost(decodes).chunk_bytes == [700 / 8 + 160 / 8 + 320 + 32 + 16] * 8
    mixed = decodes[:4] + [
        ChunkWork(num_new_tokens=4, context_len=4, samples=False, is_decode=False)
    ]
    # 4 sampling rows <= 4: the small head, 50 split 4 ways.
    body = model.step_cost(mixed).chunk_bytes[0] - 50 / 4 - 320 - 32 - 16
    assert body == pytest.approx(2384 / 8)  # 8 rows, not decode-only: the bf16 body
    nine = [ChunkWork(1, 10, samples=True, is_decode=True) for _ in range(9)]
    assert model.step_cost(nine).chunk_bytes[0] == pytest.approx(2384 / 9 + 160 / 9 + 368)


def test_gguf_layers_on_amx_tiles_read_their_blocks_up_to_the_tile_rows():
    """On an AMX CPU a GGUF model's block layers (body_tiled_*, and a head with head_rows)
    read their blocks up to tile_rows; other layers switch at small_batch_rows."""
    weights = WeightBytes(
        body_small=100, body_large=400, head_small=50, head_large=160, embedding_row=16,
        small_batch_rows=4, tile_rows=16, body_tiled_small=600, body_tiled_large=1984,
        head_rows=16,
    )  # fmt: skip
    assert weights.body(4) == 700 and weights.head(4) == 50
    assert weights.body(5) == 400 + 600 and weights.body(16) == 1000 and weights.head(16) == 50
    assert weights.body(17) == 2384 and weights.head(17) == 160
    assert (weights.small_total, weights.large_total) == (750, 2544)
    stack = dataclasses.replace(weights, decode_stack_rows=16)
    assert stack.body(16, decode_only=True) == 700 and stack.body(16) == 1000


def test_weight_bytes_dense_is_every_weight_in_the_run_time_dtype():
    dense = WeightBytes.dense(TINY)
    assert (dense.body(1), dense.body(100), dense.head(1), dense.head(100)) == (
        2384.0, 2384.0, 160.0, 160.0,
    )  # fmt: skip
    assert dense.head(0) == 0.0 and dense.embedding_row == 16.0


# TINY with layer 1 a mixture of experts: a router (8 x 4) and 4 experts of size 6 (3*8*6 =
# 144 parameters each), 2 per token, in place of its dense MLP (3*8*16 = 384).
TINY_MOE = dataclasses.replace(
    TINY,
    num_params=1272 - 384 + 8 * 4 + 4 * 144,  # 1496
    num_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=6,
    num_moe_layers=1,
)


def test_moe_flops_count_the_active_parameters():
    assert TINY_MOE.counted_params() == TINY_MOE.num_params == 1496
    # A token skips 2 of the 4 experts: 1496 - 2 * 144.
    assert TINY_MOE.num_active_params == 1208
    # Its matmuls: attention 2 * 192, layer 0's MLP 384, layer 1's router 32 + 2 experts 288
    # = 1088, the active parameters without the tied table (80) and the norms (2 * 2 * 8 + 8).
    assert TINY_MOE.active_linear_params == 1088 == 1208 - 80 - 40
    decode = ChunkWork(1, 7, samples=True, is_decode=True)
    # 2 FLOPs per active matmul weight, attention over 7 positions (64 each), the LM head.
    assert CostModel(TINY_MOE).step_cost([decode]).total_flops == 2 * 1088 + 7 * 64 + 160
    # Dense TINY: 2 * (2 * 192 + 2 * 384) = 2304 per token, as before.
    assert TINY.num_active_params == TINY.num_params
    assert CostModel(TINY).chunk_flops(ChunkWork(1, 1, False, True)) == 2304 + 64


def test_moe_bytes_read_only_the_experts_the_step_ran():
    weights = WeightBytes.dense(TINY_MOE)
    # The body without the 4 experts: (1496 - 80 - 4 * 144) * 2 bytes; one expert 144 * 2.
    assert (weights.body(1), weights.expert) == (1680.0, 288.0)
    model = CostModel(TINY_MOE, weights)
    prefill = ChunkWork(num_new_tokens=3, context_len=3, samples=True, is_decode=False)
    kv_and_rows = 3 * 32 + 3 * 32 + 3 * 16  # KV read, KV written, embedding rows
    for run in (2, 3, 4):  # 3 tokens picked 2 to 4 distinct experts
        cost = model.step_cost([prefill], num_experts_run=run)
        assert cost.total_bytes == 1680 + run * 288 + 160 + kv_and_rows
    # Unknown count: the bound min(4 experts, 3 tokens * 2 picks) per MoE layer.
    assert model.step_cost([prefill]).total_bytes == 1680 + 4 * 288 + 160 + kv_and_rows
    decode = ChunkWork(1, 3, samples=True, is_decode=True)
    assert model.step_cost([decode]).total_bytes == model.step_cost([decode], 2).total_bytes
    # A dense model ignores the count.
    assert CostModel(TINY).step_cost([decode], 5) == CostModel(TINY).step_cost([decode])


def test_from_hf_config_reads_the_moe_layers():
    from transformers import MixtralConfig, Qwen3MoeConfig

    mixtral = ModelShape.from_hf_config(
        MixtralConfig(num_hidden_layers=3, num_local_experts=8, intermediate_size=32), 2
    )
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.num_moe_layers) == (
        8, 32, 3,
    )  # fmt: skip
    qwen = Qwen3MoeConfig(
        num_hidden_layers=4, num_experts=16, num_experts_per_tok=4, moe_intermediate_size=24,
        mlp_only_layers=[0], decoder_sparse_step=1,
    )  # fmt: skip
    shape = ModelShape.from_hf_config(qwen, 2)
    assert (shape.num_experts, shape.num_experts_per_tok, shape.num_moe_layers) == (16, 4, 3)
    assert shape.num_params == shape.counted_params()
    assert ModelShape.from_hf_config(SMOLLM2_135M, 2).num_moe_layers == 0


def test_sliding_window_layers_attend_and_read_at_most_the_window() -> None:
    from engine.meter.cost_model import ChunkWork, CostModel, attended

    # Pairs by hand: a chunk of 4 at positions 6..9 under a window of 5 sees 5 keys each.
    assert attended(6, 4, 5) == 4 * 5
    assert attended(0, 4, 5) == 1 + 2 + 3 + 4
    assert attended(2, 4, 5) == 3 + 4 + 5 + 5
    assert attended(2, 4, None) == 3 + 4 + 5 + 6
    full = TINY
    windowed = dataclasses.replace(full, layer_windows=(5, None))
    chunk = ChunkWork(num_new_tokens=4, context_len=10, samples=False, is_decode=False)
    per_pair = 4 * full.q_dim
    saved_pairs = attended(6, 4, None) - attended(6, 4, 5)
    assert CostModel(full).chunk_flops(chunk) - CostModel(windowed).chunk_flops(chunk) == (
        saved_pairs * per_pair
    )
    # KV read: the windowed layer starts at position 6 - 5 + 1 = 2, so reads 8 of 10 positions.
    per_layer_token = full.kv_bytes_per_token // 2
    full_bytes = CostModel(full).step_cost([chunk]).total_bytes
    windowed_bytes = CostModel(windowed).step_cost([chunk]).total_bytes
    assert full_bytes - windowed_bytes == 2 * per_layer_token
