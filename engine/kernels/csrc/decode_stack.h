// The decoder layers of a decode-only step in one call: see decode_stack.cpp.
#pragma once

#include <cstdint>
#include <vector>

#include "gguf_linear.h"
#include "kernels.h"

namespace meterserve {

// Output columns [first_column, first_column + weight.N) of a linear stored as ggml blocks.
struct GgufPart {
  GgufWeight weight;
  int64_t first_column;
};

// A linear layer without bias, as the small-batch path reads it: a GGUF file's blocks as
// stored when `gguf` has parts (one per run of one format), else the bf16 weight in AMX tiles
// (`tiles`, amx_pack_weight's layout) or row-major (`dense`, [out_features, in_features]).
struct SmallLinear {
  std::vector<GgufPart> gguf;
  const bf16* dense = nullptr;
  const bf16* tiles = nullptr;
  int64_t out_features = 0, in_features = 0;
};

// A mixture-of-experts MLP (Qwen3-MoE, Mixtral), as SparseMoE.forward runs it: the router, a
// small linear to one logit per expert, then moe_route and moe_experts (bf16 tiles), or
// moe_experts_gguf over a GGUF file's stacked blocks where `gguf`.
struct RoutedMlp {
  SmallLinear router;
  MoeExperts experts{};
  bool gguf = false;
  MoeGgufExperts gguf_experts{};
  int64_t top_k = 0;
  bool normalize = false, round_weights = false;
  int64_t bytes_per_expert = 0;  // what one expert run reads: the meter's expert bytes
  int64_t hidden() const { return gguf ? gguf_experts.hidden : experts.hidden; }
};

struct DecodeLayer {
  const bf16* input_norm;
  const bf16* post_attention_norm;
  const bf16* q_norm = nullptr;  // [head_dim] each: Qwen3's per-head norms, else nullptr
  const bf16* k_norm = nullptr;
  SmallLinear qkv, o, gate_up, down;  // gate_up and down: a dense MLP's
  bool moe = false;                   // the MLP is `routed` instead
  RoutedMlp routed;
  bf16* key_cache;  // [slots, num_kv_heads, head_dim]
  bf16* value_cache;
};

struct DecodeStackShape {
  // intermediate_size: the dense MLPs' (0 if none); num_experts, top_k, expert_size: the MoE
  // layers' (0 if none).
  int64_t hidden_size, intermediate_size, num_experts, top_k, expert_size, num_heads,
      num_kv_heads, head_dim, block_size;
  float eps, scale;
  const bf16* cos;  // RoPE tables [max_positions, head_dim]
  const bf16* sin;
  int64_t qkv_width() const { return (num_heads + 2 * num_kv_heads) * head_dim; }
};

// One token per row, each a decode of its own request.
struct DecodeStep {
  int64_t rows;                 // 1..decode_stack_max_rows
  const int64_t* positions;     // [rows]
  const int64_t* slots;         // [rows]: the cache slot of each row's new K/V
  const int64_t* block_tables;  // [rows, max_blocks]
  int64_t max_blocks;
  const int64_t* context_lens;  // [rows], after this step's K/V
};

// The most rows a stack takes: kSmallBatchRows, or kGgufTileRows when every linear is GGUF
// blocks and AMX is usable (there gguf_tile_linear multiplies 5-16 rows for the cost of
// 1.4-2 single-row passes and 17-32 for 2.5-3, where the bf16 copy the layer loop would take
// reads 4x the bytes).
int64_t decode_stack_max_rows(bool all_gguf);

// hidden [rows, hidden_size]: the embeddings in, the final-normed hidden states out;
// residual: scratch of the same size (the residual stream). Returns how many (layer, expert)
// pairs ran (0 for a dense model), as SparseMoE counts them for the meter.
// expert_bytes: the bytes of the experts run, layer by layer (each layer's bytes_per_expert).
int64_t decode_stack(const std::vector<DecodeLayer>& layers, const DecodeStackShape& shape,
                  const DecodeStep& step, const bf16* final_norm, bf16* hidden,
                  bf16* residual, int64_t* expert_bytes);

}  // namespace meterserve
