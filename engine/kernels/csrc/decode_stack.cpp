// Every decoder layer of a decode-only step of a few rows in one native call: at most 8, or 32
// when every linear is a GGUF file's blocks and the CPU has AMX (decode_stack.h's limit). A
// mixture-of-experts layer's MLP is its router, moe_route and moe_experts, as in moe.py.
//
// At a few rows a layer is ~10 kernel calls of a few microseconds each; run one by one
// from Python, the calls, their argument checks and the tensor views between them cost about
// as much as the arithmetic (≈ 1.3 ms of a 4.7 ms single-stream step). This file makes the
// same calls, on the same kernels, in the same order and with the same roundings, as
// engine/models/llama.py does through KernelLayerOps and CpuKernelAttention, so its output is
// bit-identical to theirs (tests/integration_engine/test_decode_stack.py checks it).
#include <algorithm>
#include <vector>

#include "decode_stack.h"

namespace meterserve {
namespace {

// One GGUF part, as the gguf_linear binding multiplies it: gguf_small_linear up to 8 rows (the
// exact weights up to 4, AMX tiles above), the tiles at 9-32 (only reached on AMX).
void gguf_part(const bf16* x, const GgufWeight& w, bf16* out, int64_t rows) {
  if (rows <= kSmallBatchRows)
    gguf_small_linear(x, w, nullptr, out, rows);
  else
    gguf_tile_linear(x, w, nullptr, out, rows);
}

// Parts of a GGUF linear, each multiplied as GGUFLinear.forward does and its columns placed
// where torch.cat puts them.
void gguf_parts(const bf16* x, const SmallLinear& w, bf16* out, int64_t rows) {
  if (w.gguf.size() == 1) return gguf_part(x, w.gguf[0].weight, out, rows);
  std::vector<bf16> part_out;
  for (const GgufPart& part : w.gguf) {
    const int64_t N = part.weight.N;
    part_out.resize(rows * N);
    gguf_part(x, part.weight, part_out.data(), rows);
    for (int64_t r = 0; r < rows; ++r)
      std::copy_n(part_out.data() + r * N, N, out + r * w.out_features + part.first_column);
  }
}

void linear(const bf16* x, const SmallLinear& w, bf16* out, int64_t rows) {
  if (!w.gguf.empty())
    gguf_parts(x, w, out, rows);
  else if (w.tiles)
    tile_small_linear(x, w.tiles, nullptr, out, rows, w.out_features, w.in_features);
  else
    small_batch_linear(x, w.dense, nullptr, out, rows, w.out_features, w.in_features);
}

// Scratch of one step: the activations between the kernels, sized once per call. A MoE
// layer's: the router's logits, the picks and their weights, moe_experts' working memory
// (as moe_binding.cpp sizes it: 32 zero rows of padding after the pairs' rows), its output.
struct Activations {
  std::vector<bf16> qkv, attention, gate_up, act;
  std::vector<bf16> logits, expert_rows, expert_gate_up, expert_hidden, expert_out, moe_out;
  std::vector<int64_t> picks, pair_index;
  std::vector<float> weights;
  Activations(const DecodeStackShape& s, int64_t rows)
      : qkv(rows * s.qkv_width()),
        attention(rows * s.num_heads * s.head_dim),
        gate_up(rows * 2 * s.intermediate_size),
        act(rows * s.intermediate_size),
        logits(rows * s.num_experts),
        expert_rows(s.top_k ? (rows * s.top_k + 32) * s.hidden_size : 0),
        expert_gate_up(rows * s.top_k * 2 * s.expert_size),
        expert_hidden(s.top_k ? (rows * s.top_k + 32) * s.expert_size : 0),
        expert_out(rows * s.top_k * s.hidden_size),
        moe_out(rows * s.hidden_size),
        picks(rows * s.top_k),
        pair_index(2 * rows * s.top_k),
        weights(rows * s.top_k) {}
  MoeScratch moe_scratch(int64_t pairs) {
    return {expert_rows.data(),   expert_gate_up.data(), expert_hidden.data(),
            expert_out.data(),    pair_index.data(),     pair_index.data() + pairs};
  }
};

// The MoE MLP of hidden's rows, in place, as SparseMoE.forward computes it; returns how many
// experts ran.
int64_t routed_mlp(const RoutedMlp& moe, int64_t rows, Activations& a, bf16* hidden) {
  const int64_t num_experts =
      moe.gguf ? moe.gguf_experts.num_experts : moe.experts.num_experts;
  linear(hidden, moe.router, a.logits.data(), rows);
  moe_route(a.logits.data(), rows, num_experts, moe.top_k, moe.normalize, moe.round_weights,
            a.picks.data(), a.weights.data());
  const MoeScratch scratch = a.moe_scratch(rows * moe.top_k);
  const int64_t run =
      moe.gguf ? moe_experts_gguf(hidden, a.picks.data(), a.weights.data(), moe.round_weights,
                                  moe.gguf_experts, rows, moe.top_k, scratch, a.moe_out.data())
               : moe_experts(hidden, a.picks.data(), a.weights.data(), moe.round_weights,
                             moe.experts, rows, moe.top_k, scratch, a.moe_out.data());
  std::copy_n(a.moe_out.data(), rows * moe.hidden(), hidden);
  return run;
}

// hidden: the normalized input of the layer in, its MLP output out; residual: the stream.
// Returns how many experts the layer ran (0 for a dense MLP).
int64_t attend_and_mix(const DecodeLayer& layer, const DecodeStackShape& s,
                       const DecodeStep& step, Activations& a, bf16* hidden, bf16* residual) {
  const int64_t rows = step.rows, width = s.qkv_width();
  const int64_t q_size = s.num_heads * s.head_dim, kv_size = s.num_kv_heads * s.head_dim;
  linear(hidden, layer.qkv, a.qkv.data(), rows);
  if (layer.q_norm) {  // Qwen3: each q and k head normalized in place before RoPE
    rms_norm_heads(a.qkv.data(), width, layer.q_norm, rows, s.num_heads, s.head_dim, s.eps);
    rms_norm_heads(a.qkv.data() + q_size, width, layer.k_norm, rows, s.num_kv_heads, s.head_dim,
                   s.eps);
  }
  // q and k are adjacent in each qkv row: rotated together, as Attention.forward does.
  rotary_inplace(a.qkv.data(), width, step.positions, s.cos, s.sin, rows,
                 s.num_heads + s.num_kv_heads, s.head_dim);
  store_kv(a.qkv.data() + q_size, a.qkv.data() + q_size + kv_size, width, layer.key_cache,
           layer.value_cache, step.slots, rows, kv_size);
  paged_decode_attention(a.qkv.data(), width, layer.key_cache, layer.value_cache,
                         step.block_tables, step.max_blocks, step.context_lens,
                         a.attention.data(), rows, s.num_heads, s.num_kv_heads, s.head_dim,
                         s.block_size, s.scale, /*sliding_window=*/0, /*softcap=*/0.0f);
  linear(a.attention.data(), layer.o, hidden, rows);
  add_rms_norm(hidden, residual, layer.post_attention_norm, rows, s.hidden_size, s.eps);
  if (layer.moe) return routed_mlp(layer.routed, rows, a, hidden);
  linear(hidden, layer.gate_up, a.gate_up.data(), rows);
  silu_and_mul(a.gate_up.data(), a.act.data(), rows, s.intermediate_size);
  linear(a.act.data(), layer.down, hidden, rows);
  return 0;
}

}  // namespace

int64_t decode_stack_max_rows(bool all_gguf) {
  return all_gguf && amx_available() ? kGgufTileRows : kSmallBatchRows;
}

int64_t decode_stack(const std::vector<DecodeLayer>& layers, const DecodeStackShape& s,
                     const DecodeStep& step, const bf16* final_norm, bf16* hidden,
                     bf16* residual, int64_t* expert_bytes) {
  Activations a(s, step.rows);
  const int64_t count = step.rows * s.hidden_size;
  // The first layer: the residual stream starts as the embedding (DecoderLayer, residual None).
  std::copy(hidden, hidden + count, residual);
  rms_norm(residual, layers.front().input_norm, hidden, step.rows, s.hidden_size, s.eps);
  int64_t experts_run = 0;
  *expert_bytes = 0;
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0)
      add_rms_norm(hidden, residual, layers[i].input_norm, step.rows, s.hidden_size, s.eps);
    const int64_t run = attend_and_mix(layers[i], s, step, a, hidden, residual);
    experts_run += run;
    *expert_bytes += run * layers[i].routed.bytes_per_expert;
  }
  add_rms_norm(hidden, residual, final_norm, step.rows, s.hidden_size, s.eps);
  return experts_run;
}

}  // namespace meterserve
