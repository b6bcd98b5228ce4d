// Matrix-vector products for decode: a few rows of x against a bf16 weight, weight streamed once.
//
// oneDNN's bf16 GEMM is built for many rows; at one row it reaches only ~10 GB/s of weight
// streaming on the AMX CPUs we run on. Here every 32-element slice of a weight row is loaded
// once and multiplied into all M input rows with AVX512-BF16 dot products (bf16 pairs,
// fp32 accumulate), four weight rows at a time (two above 4 input rows, so the accumulators
// stay in registers) so there are independent accumulators.
//
//   out[m, n] = sum_k x[m, k] * weight[n, k]      m in [0, M), n in [0, N), k in [0, K)
#include <immintrin.h>

#include <algorithm>

#include "kernels.h"

namespace meterserve {
namespace {

constexpr int kLanes = 32;  // bf16 elements per 512-bit register

// Weight rows sharing one pass over x: M x tile accumulators plus M inputs fit in 32 registers.
template <int M>
constexpr int kRowsPerTile = M > 4 ? 2 : 4;

inline __m512bh load_bf16(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int M>
void linear_tile(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int64_t N,
                 int64_t K, int64_t n0) {
  constexpr int kTile = kRowsPerTile<M>;
  const int rows = static_cast<int>(std::min<int64_t>(kTile, N - n0));
  __m512 acc[M][kTile];
  for (int m = 0; m < M; ++m)
    for (int j = 0; j < kTile; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += kLanes) {
    const int64_t left = K - k;
    const __mmask32 mask = left >= kLanes ? ~__mmask32(0) : (__mmask32(1) << left) - 1;
    __m512bh xs[M];
    for (int m = 0; m < M; ++m) xs[m] = load_bf16(x + m * K + k, mask);
    for (int j = 0; j < rows; ++j) {
      const __m512bh w = load_bf16(weight + (n0 + j) * K + k, mask);
      for (int m = 0; m < M; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xs[m], w);
    }
  }
  for (int j = 0; j < rows; ++j) {
    const float b = bias ? to_float(bias[n0 + j]) : 0.0f;
    for (int m = 0; m < M; ++m)
      out[m * N + n0 + j] = from_float<bf16>(_mm512_reduce_add_ps(acc[m][j]) + b);
  }
}

template <int M>
void linear_rows(const bf16* x, const bf16* weight, const bf16* bias, bf16* out, int64_t N,
                 int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += kRowsPerTile<M>)
    linear_tile<M>(x, weight, bias, out, N, K, n0);
}

}  // namespace

void small_batch_linear(const bf16* x, const bf16* weight, const bf16* bias, bf16* out,
                        int64_t M, int64_t N, int64_t K) {
  with_small_rows(M, [&](auto rows) {
    linear_rows<decltype(rows)::value>(x, weight, bias, out, N, K);
  });
}

}  // namespace meterserve
