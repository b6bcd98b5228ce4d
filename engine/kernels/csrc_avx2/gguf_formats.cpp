// The shape checks every AVX2 kernel makes before it reads a weight's blocks.
#include "gguf_formats.h"

namespace avx2 {

int64_t row_bytes(int64_t kind, int64_t K) {
  return dispatch(static_cast<int>(kind), [&](auto format) -> int64_t {
    using F = decltype(format);
    TORCH_CHECK(K > 0 && K % F::kWeights == 0, "gguf (AVX2): K = ", K,
                " is not a whole number of blocks of ", F::kWeights);
    return K / F::kWeights * F::kBytes;
  });
}

void check_blocks(const torch::Tensor& blocks, int64_t N, int64_t bytes) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 &&
                  blocks.is_contiguous() && blocks.numel() == N * bytes,
              "gguf (AVX2): blocks must be contiguous uint8 holding ", N, " x ", bytes, " bytes");
}

const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                  bias->numel() == N,
              "gguf (AVX2): bias must be contiguous float32 [N]");
  return bias->data_ptr<float>();
}

}  // namespace avx2
