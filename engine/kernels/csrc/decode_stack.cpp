// Every decoder layer of a decode-only step of a few rows in one native call: at most 8, or 32
// when every linear is a GGUF file's blocks and the CPU has AMX (decode_stack.h's limit).
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

// Scratch of one step: the activations between the kernels, sized once per call.
struct Activations {
  std::vector<bf16> qkv, attention, gate_up, act;
  Activations(const DecodeStackShape& s, int64_t rows)
      : qkv(rows * s.qkv_width()),
        attention(rows * s.num_heads * s.head_dim),
        gate_up(rows * 2 * s.intermediate_size),
        act(rows * s.intermediate_size) {}
};

// hidden: the normalized input of the layer in, its MLP output out; residual: the stream.
void attend_and_mix(const DecodeLayer& layer, const DecodeStackShape& s, const DecodeStep& step,
                    Activations& a, bf16* hidden, bf16* residual) {
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
  linear(hidden, layer.gate_up, a.gate_up.data(), rows);
  silu_and_mul(a.gate_up.data(), a.act.data(), rows, s.intermediate_size);
  linear(a.act.data(), layer.down, hidden, rows);
}

}  // namespace

int64_t decode_stack_max_rows(bool all_gguf) {
  return all_gguf && amx_available() ? kGgufTileRows : kSmallBatchRows;
}

void decode_stack(const std::vector<DecodeLayer>& layers, const DecodeStackShape& s,
                  const DecodeStep& step, const bf16* final_norm, bf16* hidden,
                  bf16* residual) {
  Activations a(s, step.rows);
  const int64_t count = step.rows * s.hidden_size;
  // The first layer: the residual stream starts as the embedding (DecoderLayer, residual None).
  std::copy(hidden, hidden + count, residual);
  rms_norm(residual, layers.front().input_norm, hidden, step.rows, s.hidden_size, s.eps);
  for (size_t i = 0; i < layers.size(); ++i) {
    if (i > 0)
      add_rms_norm(hidden, residual, layers[i].input_norm, step.rows, s.hidden_size, s.eps);
    attend_and_mix(layers[i], s, step, a, hidden, residual);
  }
  add_rms_norm(hidden, residual, final_norm, step.rows, s.hidden_size, s.eps);
}

}  // namespace meterserve
