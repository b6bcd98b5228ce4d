// The AVX512-BF16 product of 1-4 rows of x by four row-major bf16 weight rows, for the GGUF
// panels without AMX (gguf_panel.cpp, over a decoded panel, more than 8 rows).
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "numeric.h"
#include "vec.h"

namespace meterserve {

// out[m, n + j] for m < MR, j < cols (<= 4): 4 weight rows of the panel against MR rows of x.
// Each product's 16 lane sums are added across lanes by one transposed reduction of all 16
// accumulators (sum_each_of_16: 45 shuffles and adds where 16 separate reductions take ~130),
// which leaves out[m, n .. n + 3] in 128-bit lane m. A row's sums do not depend on MR.
template <int MR>
void vector_tile(const bf16* x, const bf16* w, int64_t K, const bf16* bias, bf16* out,
                 int64_t N, int64_t n, int64_t cols) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xs[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xs[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[4 * m + j] = _mm512_dpbf16_ps(acc[4 * m + j], xs[m], wv);
    }
  }
  __m512 sums = sum_each_of_16(acc);
  if (bias) {
    alignas(16) float b[4] = {};
    for (int j = 0; j < cols; ++j) b[j] = to_float(bias[n + j]);
    sums = _mm512_add_ps(sums, _mm512_broadcast_f32x4(_mm_load_ps(b)));
  }
  alignas(32) uint64_t rounded[4];  // row m's four bf16 results
  _mm256_store_si256(reinterpret_cast<__m256i*>(rounded), bf16_words(sums));
  for (int m = 0; m < MR; ++m) std::memcpy(out + m * N + n, rounded + m, 2 * cols);
}

// vector_tile over the first `rows` (1-4) rows of x.
inline void vector_tile_rows(const bf16* x, int64_t rows, const bf16* w, int64_t K,
                             const bf16* bias, bf16* out, int64_t N, int64_t n, int64_t cols) {
  switch (rows) {
    case 1: return vector_tile<1>(x, w, K, bias, out, N, n, cols);
    case 2: return vector_tile<2>(x, w, K, bias, out, N, n, cols);
    case 3: return vector_tile<3>(x, w, K, bias, out, N, n, cols);
    default: return vector_tile<4>(x, w, K, bias, out, N, n, cols);
  }
}

}  // namespace meterserve
