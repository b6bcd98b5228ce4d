// Products over GGUF blocks for more than 8 rows (batched decode, prefill).
//
// No float copy of the weight exists: each thread dequantizes a panel of weight rows (the
// exact weights rounded to bf16, gguf::bf16_weights) into a small buffer of its own, row-major
// [panel rows, K], and multiplies every row of x by it while it is in L2; the panel is then
// dropped. Each weight is thus decoded once per chunk of kRowsPerChunk rows of x.
// AMX: the panel is the tile product's A operand (row-major, as decoded: no re-layout of the
// weight) and x, packed once per call in amx_pack_weight's tile layout, the B operand; so
// amx::multiply_block (amx_linear.cpp) yields each 32 x 32 output block transposed, and
// write_transposed puts it back. Without AMX: AVX512-BF16 dot products, 4 x 4 rows at a time.
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int64_t kRowsPerChunk = 256;  // rows of x multiplied per decoded panel, kept in L2

// Weight rows [n0, n0 + rows) as bf16, row-major [panel_rows, K]; rows past `rows` zero.
// scale and min: room for one row's K / kGroup of each.
template <class F>
void decode_panel(const GgufWeight& w, int64_t n0, int64_t rows, int64_t panel_rows,
                  bf16* panel, float* scale, float* min) {
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes, subs = w.K / 32;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = w.blocks + (n0 + i) * row_bytes;
    // The same row of the next panel (the thread's next item: static scheduling gives it
    // consecutive panels), so it arrives during this panel's products instead of stalling
    // the next decode.
    prefetch_lines(row + panel_rows * row_bytes, row_bytes);
    gguf::read_params<F>(row, w.K, scale, min);
    bf16* dst = panel + i * w.K;
    for (int64_t b = 0; b < subs; ++b)
      _mm512_storeu_si512(dst + b * 32, (__m512i)gguf::bf16_weights<F>(row, b, scale, min));
  }
  std::fill(panel + rows * w.K, panel + panel_rows * w.K, bf16{0});
}

// A thread's scratch: one row's scales and mins, and the decoded panel.
struct Scratch {
  std::vector<float> scale, min;
  std::vector<bf16> panel;
  template <class F>
  Scratch(F, int64_t K, int64_t panel_rows)
      : scale(K / F::kGroup), min(K / F::kGroup), panel(panel_rows * K) {}
};

#ifdef __AMX_BF16__

constexpr int64_t kPanelRows = 32;  // weight rows per panel: the 32 rows of one block's A tiles

template <class F>
void panel_amx(const bf16* x_tiles, int64_t padded_rows, const GgufWeight& w, const bf16* bias,
               bf16* out, int64_t M) {
  const amx::TileConfig config = amx::eight_full_tiles();
  for (int64_t chunk = 0; chunk < padded_rows; chunk += kRowsPerChunk) {
    const int64_t chunk_end = std::min(padded_rows, chunk + kRowsPerChunk);
#pragma omp parallel
    {
      _tile_loadconfig(&config);  // tile state is per thread
      Scratch s(F{}, w.K, kPanelRows);
      alignas(64) float block[32 * 32];
#pragma omp for schedule(static)
      for (int64_t n0 = 0; n0 < w.N; n0 += kPanelRows) {
        const int64_t cols = std::min(kPanelRows, w.N - n0);
        decode_panel<F>(w, n0, cols, kPanelRows, s.panel.data(), s.scale.data(), s.min.data());
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
          amx::multiply_block(s.panel.data(), x_tiles, w.K, 0, m0, block);
          amx::write_transposed(block, bias, out, w.N, m0, std::min<int64_t>(32, M - m0), n0,
                                cols);
        }
      }
      _tile_release();
    }
  }
}

#endif  // __AMX_BF16__

constexpr int64_t kVectorPanelRows = 16;

// out[m, n + j] for m < MR, j < cols (<= 4): 4 weight rows of the panel against MR rows of x.
template <int MR>
void vector_tile(const bf16* x, const bf16* w, int64_t K, const bf16* bias, bf16* out,
                 int64_t N, int64_t n, int64_t cols) {
  __m512 acc[MR][4];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xs[MR];
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) xs[m] = (__m512bh)_mm512_loadu_si512(x + m * K + k);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) {
      const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + j * K + k);
#pragma GCC unroll 4
      for (int m = 0; m < MR; ++m) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xs[m], wv);
    }
  }
  for (int j = 0; j < cols; ++j) {
    const float b = bias ? to_float(bias[n + j]) : 0.0f;
    for (int m = 0; m < MR; ++m)
      out[m * N + n + j] = from_float<bf16>(_mm512_reduce_add_ps(acc[m][j]) + b);
  }
}

template <class F>
void panel_vector(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out, int64_t M) {
  const int64_t K = w.K;
  for (int64_t chunk = 0; chunk < M; chunk += kRowsPerChunk) {
    const int64_t chunk_end = std::min(M, chunk + kRowsPerChunk);
#pragma omp parallel
    {
      Scratch s(F{}, K, kVectorPanelRows);
      const bf16* panel = s.panel.data();
#pragma omp for schedule(static)
      for (int64_t n0 = 0; n0 < w.N; n0 += kVectorPanelRows) {
        const int64_t cols = std::min(kVectorPanelRows, w.N - n0);
        decode_panel<F>(w, n0, cols, kVectorPanelRows, s.panel.data(), s.scale.data(),
                        s.min.data());
        for (int64_t m = chunk; m < chunk_end; m += 4) {
          const bf16* xs = x + m * K;
          bf16* dst = out + m * w.N;
          for (int64_t j = 0; j < cols; j += 4) {
            const int64_t c = std::min<int64_t>(4, cols - j);
            switch (std::min<int64_t>(4, chunk_end - m)) {
              case 1: vector_tile<1>(xs, panel + j * K, K, bias, dst, w.N, n0 + j, c); break;
              case 2: vector_tile<2>(xs, panel + j * K, K, bias, dst, w.N, n0 + j, c); break;
              case 3: vector_tile<3>(xs, panel + j * K, K, bias, dst, w.N, n0 + j, c); break;
              default: vector_tile<4>(xs, panel + j * K, K, bias, dst, w.N, n0 + j, c);
            }
          }
        }
      }
    }
  }
}

}  // namespace

#ifdef __AMX_BF16__
// amx.h: also the epilogue of gguf_tiles.cpp.
void amx::write_transposed(const float* block, const bf16* bias, bf16* out, int64_t N,
                           int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  const __m512i column = _mm512_mullo_epi32(
      _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
      _mm512_set1_epi32(32));
  const int64_t cols_lo = std::min<int64_t>(cols, kVecLanes), cols_hi = cols - cols_lo;
  const __m512 bias_lo = bias ? load(bias + n0, cols_lo) : _mm512_setzero_ps();
  const __m512 bias_hi = bias && cols_hi ? load(bias + n0 + kVecLanes, cols_hi)
                                         : _mm512_setzero_ps();
  for (int64_t j = 0; j < rows; ++j) {
    bf16* dst = out + (m0 + j) * N + n0;
    const __m512 lo = _mm512_i32gather_ps(column, block + j, 4);
    store(dst, _mm512_add_ps(lo, bias_lo), cols_lo);
    if (cols_hi) {
      const __m512 hi = _mm512_i32gather_ps(column, block + kVecLanes * 32 + j, 4);
      store(dst + kVecLanes, _mm512_add_ps(hi, bias_hi), cols_hi);
    }
  }
}
#endif  // __AMX_BF16__

void gguf_panel_linear_amx(const bf16* x_tiles, int64_t padded_rows, const GgufWeight& w,
                           const bf16* bias, bf16* out, int64_t M) {
#ifdef __AMX_BF16__
  gguf::dispatch(w.kind, [&](auto format) {
    panel_amx<decltype(format)>(x_tiles, padded_rows, w, bias, out, M);
  });
#else
  throw std::runtime_error("gguf_linear: built without AMX support");
#endif
}

void gguf_panel_linear_vector(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                              int64_t M) {
  gguf::dispatch(w.kind, [&](auto format) {
    panel_vector<decltype(format)>(x, w, bias, out, M);
  });
}

}  // namespace meterserve
