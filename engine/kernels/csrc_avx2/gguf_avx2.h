// The AVX2 module's kernels (bindings.cpp names them for Python): a GGUF weight's blocks as
// stored times float32 inputs, on CPUs with AVX2 + FMA + F16C and no AVX-512.
#pragma once

#include <torch/extension.h>

namespace avx2 {

// The most rows gguf_matvec_f32 and gguf_matvec_int8 take.
constexpr int64_t kMaxRows = 8;

torch::Tensor gguf_dequantize_f32(const torch::Tensor& blocks, int64_t kind, int64_t N,
                                  int64_t K);
torch::Tensor gguf_matvec_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                              int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor gguf_panel_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                             int64_t N, const c10::optional<torch::Tensor>& bias);
torch::Tensor gguf_matvec_int8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                               int64_t N, const c10::optional<torch::Tensor>& bias);

}  // namespace avx2
