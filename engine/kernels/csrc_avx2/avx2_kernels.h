// The AVX2 module's kernels (bindings.cpp names them for Python), the float32 serving path on
// CPUs with AVX2 + FMA + F16C and no AVX-512: a GGUF weight's blocks as stored times float32
// inputs, decode attention over the float32 paged cache, and a layer's row-wise operations.
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

torch::Tensor paged_decode_attention_f32(const torch::Tensor& query, const torch::Tensor& key_cache,
                                         const torch::Tensor& value_cache,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& context_lens, int64_t block_size,
                                         double scale, int64_t sliding_window, double softcap);


// A decoder layer's row-wise operations in float32 (layer_ops.cpp), as csrc/elementwise.cpp's.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
void rms_norm_heads_(torch::Tensor& x, int64_t first_column, const torch::Tensor& weight,
                     int64_t num_heads, double eps);
void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                   double eps);
torch::Tensor silu_and_mul(const torch::Tensor& gate_up);
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos,
             const torch::Tensor& sin, int64_t num_heads, int64_t head_dim);

}  // namespace avx2
