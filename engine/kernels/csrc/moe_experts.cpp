// A mixture-of-experts layer's experts in one native call, after the router has picked: the
// (token, pick) pairs sorted by expert, their rows gathered, one grouped product for gate_up,
// silu_and_mul, one for down, and the weighted sum back into token order. The Python version
// of the same steps (moe.py SparseMoE._forward_torch) ran ~20 torch ops a layer: at one token
// ~0.4 ms a layer of Python and dispatch, at 2,048 tokens ~30 ms of float32 temporaries
// (weighted, index_copy_, sum), a third of the layer.
//
// Rounding as in moe.py, which is as transformers' grouped_mm block rounds: each expert
// output rounded to bf16; weight * output in fp32, itself rounded to bf16 when the weights are
// bf16 (Qwen3-MoE: a bf16 x bf16 product); the k products summed in pick order in fp32 and
// rounded once.
//
// Experts in the tile layout, multiplied by amx_grouped_linear on an AMX CPU, else by
// vector_grouped_linear: the same steps around either product. moe_experts_gguf: a GGUF
// file's experts as stored, each picked expert's rows through gguf_linear's path for them.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "gguf_linear.h"
#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int64_t kParallelPairs = 64;  // fewer rows are gathered or summed on one thread

// order[s] = the pair at sorted position s (pairs by expert, stably), position[p] = its s;
// groups: (expert, first sorted row, rows) of each expert picked, by expert id.
std::vector<int64_t> sort_pairs(const int64_t* picks, int64_t pairs, int64_t num_experts,
                                int64_t* order, int64_t* position) {
  std::vector<int64_t> next(num_experts + 1, 0);
  for (int64_t p = 0; p < pairs; ++p) ++next[picks[p] + 1];
  std::vector<int64_t> groups;
  for (int64_t e = 0; e < num_experts; ++e) {
    if (next[e + 1]) groups.insert(groups.end(), {e, next[e], next[e + 1]});
    next[e + 1] += next[e];
  }
  for (int64_t p = 0; p < pairs; ++p) {
    const int64_t s = next[picks[p]]++;
    order[s] = p;
    position[p] = s;
  }
  return groups;
}

void gather_rows(const bf16* x, const int64_t* order, int64_t pairs, int64_t k, int64_t hidden,
                 bf16* rows) {
#pragma omp parallel for if (pairs >= kParallelPairs)
  for (int64_t s = 0; s < pairs; ++s)
    std::memcpy(rows + s * hidden, x + (order[s] / k) * hidden, hidden * sizeof(bf16));
}

void weighted_sum(const bf16* expert_out, const int64_t* position, const float* weights,
                  bool round_products, int64_t tokens, int64_t k, int64_t hidden, bf16* out) {
#pragma omp parallel for if (tokens * k >= kParallelPairs)
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < hidden; h += kVecLanes) {
      const int64_t lanes = std::min<int64_t>(kVecLanes, hidden - h);
      __m512 sum = _mm512_setzero_ps();
      for (int64_t j = 0; j < k; ++j) {
        const int64_t p = t * k + j;
        __m512 product = _mm512_mul_ps(load(expert_out + position[p] * hidden + h, lanes),
                                       _mm512_set1_ps(weights[p]));
        if (round_products) product = round<bf16>(product);
        sum = _mm512_add_ps(sum, product);
      }
      store(out + t * hidden + h, sum, lanes);
    }
  }
}

}  // namespace

int64_t moe_experts(const bf16* x, const int64_t* picks, const float* weights,
                    bool round_products, const MoeExperts& experts, int64_t tokens, int64_t k,
                    const MoeScratch& scratch, bf16* out) {
  const int64_t pairs = tokens * k, hidden = experts.hidden, inter = experts.inter;
  const std::vector<int64_t> groups =
      sort_pairs(picks, pairs, experts.num_experts, scratch.order, scratch.position);
  const int64_t num_groups = static_cast<int64_t>(groups.size()) / 3;
  gather_rows(x, scratch.order, pairs, k, hidden, scratch.rows);
  const auto grouped_linear = amx_available() ? amx_grouped_linear : vector_grouped_linear;
  grouped_linear(scratch.rows, experts.gate_up, groups.data(), num_groups, scratch.gate_up_out,
                 2 * inter, hidden);
  silu_and_mul(scratch.gate_up_out, scratch.hidden, pairs, inter);
  grouped_linear(scratch.hidden, experts.down, groups.data(), num_groups, scratch.expert_out,
                 hidden, inter);
  weighted_sum(scratch.expert_out, scratch.position, weights, round_products, tokens, k, hidden,
               out);
  return num_groups;
}

namespace {

// Expert e's rows of a stacked GGUF tensor: the e-th run of `rows` rows.
GgufWeight expert_rows(const GgufWeight& all, int64_t e, int64_t rows) {
  GgufWeight w = all;
  w.blocks = all.blocks + e * rows * gguf_row_bytes(all.kind, all.K);
  w.N = rows;
  return w;
}

}  // namespace

int64_t moe_experts_gguf(const bf16* x, const int64_t* picks, const float* weights,
                         bool round_products, const MoeGgufExperts& experts, int64_t tokens,
                         int64_t k, const MoeScratch& scratch, bf16* out) {
  const int64_t pairs = tokens * k, hidden = experts.hidden, inter = experts.inter;
  const std::vector<int64_t> groups =
      sort_pairs(picks, pairs, experts.num_experts, scratch.order, scratch.position);
  const int64_t num_groups = static_cast<int64_t>(groups.size()) / 3;
  gather_rows(x, scratch.order, pairs, k, hidden, scratch.rows);
  auto product = [&](const GgufWeight& all, int64_t e, int64_t rows, const bf16* in,
                     int64_t n, bf16* result) {
    gguf_linear_rows(in, expert_rows(all, e, rows), nullptr, result, n, experts.use_amx,
                     experts.small_rows);
  };
  // One product at a time, each parallel inside (splitting the experts over the threads
  // instead, each product on one thread, measured no faster for one token of a 64-expert
  // top-8 Q4_K_M model on 2 Zen 4 cores: 13.9-15.5 ms of experts a token against 14.6-14.9).
  std::vector<bf16> gate, up;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t e = groups[3 * g], first = groups[3 * g + 1], n = groups[3 * g + 2];
    gate.resize(n * inter);
    up.resize(n * inter);
    product(experts.gate, e, inter, scratch.rows + first * hidden, n, gate.data());
    product(experts.up, e, inter, scratch.rows + first * hidden, n, up.data());
    for (int64_t r = 0; r < n; ++r) {  // gate | up side by side, as silu_and_mul reads them
      bf16* row = scratch.gate_up_out + (first + r) * 2 * inter;
      std::memcpy(row, gate.data() + r * inter, inter * sizeof(bf16));
      std::memcpy(row + inter, up.data() + r * inter, inter * sizeof(bf16));
    }
  }
  silu_and_mul(scratch.gate_up_out, scratch.hidden, pairs, inter);
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t e = groups[3 * g], first = groups[3 * g + 1], n = groups[3 * g + 2];
    product(experts.down, e, hidden, scratch.hidden + first * inter, n,
            scratch.expert_out + first * hidden);
  }
  weighted_sum(scratch.expert_out, scratch.position, weights, round_products, tokens, k, hidden,
               out);
  return num_groups;
}

}  // namespace meterserve
