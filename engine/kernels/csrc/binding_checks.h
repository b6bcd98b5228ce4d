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

}  // namespace meterserve
