// What every binding file shares: argument checks and raw-pointer access on torch tensors.
#pragma once

#include <torch/extension.h>

#include "kernels.h"

namespace meterserve {

inline void check_row_major(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.stride(-1) == 1, name, " must have a contiguous last dimension");
}

inline void check_same_dtype(const torch::Tensor& a, const torch::Tensor& b, const char* what) {
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), what, ": dtypes differ (", a.scalar_type(),
              " vs ", b.scalar_type(), ")");
}

// Indices come from our own scheduler, but a bad one would write outside a tensor: check.
inline void check_indices(const int64_t* values, int64_t count, int64_t limit, const char* what) {
  for (int64_t i = 0; i < count; ++i)
    TORCH_CHECK(values[i] >= 0 && values[i] < limit, what, " ", values[i], " out of [0, ", limit, ")");
}

template <typename T>
T* data(const torch::Tensor& t) {
  return reinterpret_cast<T*>(t.data_ptr());
}

// An optional linear bias, checked as contiguous bfloat16 [N]: its data, or nullptr.
inline const bf16* bias_data(const c10::optional<torch::Tensor>& bias, int64_t N,
                             const char* what) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->is_contiguous() && bias->numel() == N &&
                  bias->scalar_type() == torch::kBFloat16,
              what, ": bias must be bfloat16 [", N, "]");
  return data<bf16>(*bias);
}

// `lead` leading dimensions, then amx_pack_weight's tile layout [N / 16, K / 32, 16, 16, 2] for
// x of K columns; `layout` says what the caller expects when the layout is wrong.
inline void check_tile_layout(const torch::Tensor& t, int64_t lead, int64_t K, const char* what,
                              const char* layout) {
  TORCH_CHECK(t.dim() == lead + 5 && t.scalar_type() == torch::kBFloat16 && t.is_contiguous() &&
                  t.size(lead + 2) == 16 && t.size(lead + 3) == 16 && t.size(lead + 4) == 2,
              what, ": ", layout);
  TORCH_CHECK(t.size(lead + 1) * 32 == K, what, ": K of x and weight differ");
}

// A weight in amx_pack_weight's tile layout for x of K columns.
inline void check_tiles(const torch::Tensor& packed, int64_t K, const char* what) {
  check_tile_layout(packed, 0, K, what, "packed must come from amx_pack_weight");
}

// A GGUF file's stacked experts as moe_experts_gguf reads them: contiguous uint8 blocks of
// ggml type `kind`, E experts of `rows` rows of `cols` weights each.
inline GgufWeight stacked_gguf_experts(const torch::Tensor& blocks, int64_t kind, int64_t E,
                                       int64_t rows, int64_t cols, bool int8_activations,
                                       const char* what) {
  const int64_t row_bytes = gguf_row_bytes(static_cast<int>(kind), cols);
  TORCH_CHECK(row_bytes > 0, what, ": ggml type ", kind, " is not supported, or ", cols,
              " is not a whole number of its blocks");
  TORCH_CHECK(blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous() &&
                  blocks.numel() == E * rows * row_bytes,
              what, ": contiguous uint8 of ", E, " x ", rows, " x ", row_bytes, " bytes");
  return GgufWeight{static_cast<int>(kind), data<uint8_t>(blocks), E * rows, cols,
                    int8_activations};
}

// A mixture-of-experts layer's weights [E, N / 16, K / 32, 16, 16, 2]: each expert in
// amx_pack_weight's tile layout, for x of K columns.
inline void check_expert_tiles(const torch::Tensor& experts, int64_t K, const char* what) {
  check_tile_layout(experts, 1, K, what, "experts must be [E, ...] of amx_pack_weight layouts");
}

// groups int64 [G, 3] of (expert < E, first_row, num_rows): disjoint, increasing row ranges
// inside [0, rows).
inline void check_groups(const torch::Tensor& groups, int64_t E, int64_t rows) {
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 3 && groups.scalar_type() == torch::kInt64 &&
                  groups.is_contiguous(),
              "groups must be int64 [G, 3]: (expert, first_row, num_rows)");
  const int64_t* g = data<int64_t>(groups);
  int64_t next = 0;
  for (int64_t i = 0; i < groups.size(0); ++i) {
    TORCH_CHECK(g[3 * i] >= 0 && g[3 * i] < E, "group expert out of range");
    TORCH_CHECK(g[3 * i + 1] >= next && g[3 * i + 2] >= 0 && g[3 * i + 1] + g[3 * i + 2] <= rows,
                "groups must hold disjoint, increasing row ranges inside x");
    next = g[3 * i + 1] + g[3 * i + 2];
  }
}

// Calls fn.template operator()<T>() with T = float or bf16 from the tensor's dtype.
template <typename Fn>
void dispatch(const torch::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == torch::kFloat32) return fn(float{});
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "expected float32 or bfloat16, got ",
              t.scalar_type());
  return fn(bf16{});
}

}  // namespace meterserve
