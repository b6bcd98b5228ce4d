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

// Calls fn.template operator()<T>() with T = float or bf16 from the tensor's dtype.
template <typename Fn>
void dispatch(const torch::Tensor& t, Fn&& fn) {
  if (t.scalar_type() == torch::kFloat32) return fn(float{});
  TORCH_CHECK(t.scalar_type() == torch::kBFloat16, "expected float32 or bfloat16, got ",
              t.scalar_type());
  return fn(bf16{});
}

// kind 0 = Q4_1: codes uint8 [N, K / 2], scales and mins float32 [N, K / 32];
// kind 1 = Q8_0: codes int8 [N, K], scales float32 [N, K / 32], no mins.
inline QuantizedWeight quantized_weight(int64_t kind, const torch::Tensor& codes,
                                        const torch::Tensor& scales,
                                        const c10::optional<torch::Tensor>& mins, int64_t K) {
  TORCH_CHECK(kind == 0 || kind == 1, "quantized weight: kind must be 0 (Q4_1) or 1 (Q8_0)");
  TORCH_CHECK(K % 32 == 0, "quantized weight: K must be a multiple of 32");
  const int64_t N = codes.size(0);
  TORCH_CHECK(codes.is_contiguous() && codes.dim() == 2 && codes.element_size() == 1 &&
                  codes.size(1) == (kind == 0 ? K / 2 : K),
              "codes must be contiguous [N, K / 2] (Q4_1) or [N, K] (Q8_0) bytes");
  TORCH_CHECK(scales.is_contiguous() && scales.scalar_type() == torch::kFloat32 &&
                  scales.numel() == N * (K / 32),
              "scales must be contiguous float32 [N, K / 32]");
  TORCH_CHECK(kind == 1 || (mins.has_value() && mins->is_contiguous() &&
                            mins->scalar_type() == torch::kFloat32 && mins->numel() == N * (K / 32)),
              "Q4_1 needs mins, contiguous float32 [N, K / 32]");
  return QuantizedWeight{static_cast<QuantKind>(kind),
                         reinterpret_cast<const uint8_t*>(codes.data_ptr()), data<float>(scales),
                         kind == 0 ? data<float>(*mins) : nullptr};
}

}  // namespace meterserve
