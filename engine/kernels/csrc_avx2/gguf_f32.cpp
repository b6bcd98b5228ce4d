// GGUF blocks as stored, for CPUs with AVX2 + FMA + F16C and no AVX-512 (AMD Zen 2/3, older
// Xeons, desktop chips): the float32 serving path reads the file's blocks, never a float copy.
//
//   gguf_dequantize_f32: w [N, K] float32 from the blocks, equal to gguf-py bit for bit
//                        (engine/gguf_blocks.py's reference): w = fma(scale, q, min).
//   gguf_matvec_f32:     out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for 1-8 rows of float32
//                        x: each weight row's blocks are read once, dequantized in registers
//                        to those same exact weights, and multiplied into every row (fp32
//                        sums, 8 lanes, then a horizontal sum); threads split the weight rows.
//   gguf_panel_f32:      the same product for any M, over weight panels dequantized once per
//                        call (below).
// GGUFLinear picks by row count; the largest passes dequantize per call into torch's matmul.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "avx2_kernels.h"
#include "gguf_formats.h"

namespace avx2 {
namespace {

// Sub-block s of `block`, its weights exactly: w[v] holds elements 8 v .. 8 v + 7.
template <class F>
inline void sub_block_weights(const uint8_t* block, int s, const float* scale, const float* min,
                              __m256 w[4]) {
  const __m256i codes = F::codes(block, s);
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m128i bytes = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
    const __m256i ints = F::kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    const int g = (32 * s + 8 * v) / F::kGroup;
    w[v] = _mm256_fmadd_ps(_mm256_set1_ps(scale[g]), _mm256_cvtepi32_ps(ints),
                           _mm256_set1_ps(min[g]));
  }
}

// The row's blocks in order: fn(s_global, w[4]) for each 32-weight sub-block.
template <class F, typename Fn>
inline void for_each_sub_block(const uint8_t* row, int64_t K, Fn&& fn) {
  constexpr int kGroups = F::kWeights / F::kGroup, kSubs = F::kWeights / 32;
  float scale[kGroups], min[kGroups];
  __m256 w[4];
  for (int64_t blk = 0; blk < K / F::kWeights; ++blk) {
    const uint8_t* block = row + blk * F::kBytes;
    F::params(block, scale, min);
#pragma GCC unroll 8
    for (int s = 0; s < kSubs; ++s) {
      sub_block_weights<F>(block, s, scale, min, w);
      fn(blk * kSubs + s, w);
    }
  }
}

// Independent fma chains per row (one chain stalls on fma latency); AVX2 has 16 registers.
template <int M>
constexpr int kChains = M <= 2 ? 4 : M <= 4 ? 2 : 1;

template <class F, int M>
void matvec_rows(const float* x, const uint8_t* blocks, int64_t N, int64_t K, const float* bias,
                 float* out) {
  constexpr int kC = kChains<M>;
  const int64_t row_bytes = K / F::kWeights * F::kBytes;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    __m256 acc[M][kC];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kC; ++c) acc[m][c] = _mm256_setzero_ps();
    for_each_sub_block<F>(blocks + n * row_bytes, K, [&](int64_t b, const __m256 w[4]) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const float* xs = x + m * K + b * 32;
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          acc[m][v % kC] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xs + 8 * v), acc[m][v % kC]);
      }
    });
    for (int m = 0; m < M; ++m) {
      __m256 total = acc[m][0];
      for (int c = 1; c < kC; ++c) total = _mm256_add_ps(total, acc[m][c]);
      out[m * N + n] = hsum(total) + (bias ? bias[n] : 0.0f);
    }
  }
}

// Any M: threads take panels of kPanel weight rows, dequantize each panel once into a
// thread-local buffer [kPanel, K] (the exact weights; K <= ~2,000 keeps it in L1/L2), then
// multiply it into every input row, kXRows rows at a time (a kPanel x kXRows block of fma
// chains: 12 accumulators + 4 + 3 loads per step fit AVX2's 16 registers).
constexpr int kPanel = 4, kXRows = 3;

template <int R>
inline void panel_dot(const float* panel, const float* x, int64_t K, int64_t M, int64_t m,
                      float out[kPanel][kXRows]) {
  __m256 acc[kPanel][R];
  for (int i = 0; i < kPanel; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xs[R];
#pragma GCC unroll 3
    for (int j = 0; j < R; ++j) xs[j] = _mm256_loadu_ps(x + (m + j) * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < kPanel; ++i) {
      const __m256 w = _mm256_loadu_ps(panel + i * K + k);
#pragma GCC unroll 3
      for (int j = 0; j < R; ++j) acc[i][j] = _mm256_fmadd_ps(w, xs[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kPanel; ++i)
    for (int j = 0; j < R; ++j) out[i][j] = hsum(acc[i][j]);
  (void)M;
}

template <class F>
void panel_rows(const float* x, const uint8_t* blocks, int64_t N, int64_t K, int64_t M,
                const float* bias, float* out) {
  const int64_t row_bytes = K / F::kWeights * F::kBytes;
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel
  {
    std::vector<float> panel(kPanel * K, 0.0f);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanel, rows = std::min<int64_t>(kPanel, N - n0);
      for (int64_t i = 0; i < rows; ++i) {
        float* w_row = panel.data() + i * K;
        for_each_sub_block<F>(blocks + (n0 + i) * row_bytes, K, [&](int64_t b, const __m256 w[4]) {
          for (int v = 0; v < 4; ++v) _mm256_storeu_ps(w_row + b * 32 + 8 * v, w[v]);
        });
      }
      float sums[kPanel][kXRows];
      for (int64_t m = 0; m < M; m += kXRows) {
        const int64_t r = std::min<int64_t>(kXRows, M - m);
        if (r == 3) panel_dot<3>(panel.data(), x, K, M, m, sums);
        else if (r == 2) panel_dot<2>(panel.data(), x, K, M, m, sums);
        else panel_dot<1>(panel.data(), x, K, M, m, sums);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < r; ++j)
            out[(m + j) * N + n0 + i] = sums[i][j] + (bias ? bias[n0 + i] : 0.0f);
      }
    }
  }
}

}  // namespace

torch::Tensor gguf_dequantize_f32(const torch::Tensor& blocks, int64_t kind, int64_t N,
                                  int64_t K) {
  check_blocks(blocks, N, row_bytes(kind, K));
  auto out = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  dispatch(static_cast<int>(kind), [&](auto format) {
    using F = decltype(format);
    const int64_t bytes = K / F::kWeights * F::kBytes;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* w_row = dst + n * K;
      for_each_sub_block<F>(src + n * bytes, K, [&](int64_t b, const __m256 w[4]) {
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(w_row + b * 32 + 8 * v, w[v]);
      });
    }
  });
  return out;
}

torch::Tensor gguf_panel_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                             int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == torch::kFloat32 &&
                  x.is_contiguous(),
              "gguf_panel_f32: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, N, row_bytes(kind, K));
  const float* bias_ptr = checked_bias(bias, N);
  auto out = torch::empty({M, N}, torch::kFloat32);
  dispatch(static_cast<int>(kind), [&](auto format) {
    panel_rows<decltype(format)>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), N, K, M,
                                 bias_ptr, out.data_ptr<float>());
  });
  return out;
}

torch::Tensor gguf_matvec_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                              int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
                  x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "gguf_matvec_f32: x must be contiguous float32 [1..", kMaxRows, ", K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, N, row_bytes(kind, K));
  const float* bias_ptr = checked_bias(bias, N);
  auto out = torch::empty({M, N}, torch::kFloat32);
  const float* xs = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  dispatch(static_cast<int>(kind), [&](auto format) {
    using F = decltype(format);
    with_rows(M, [&](auto rows) {
      matvec_rows<F, decltype(rows)::value>(xs, w, N, K, bias_ptr, o);
    });
  });
  return out;
}

}  // namespace avx2
