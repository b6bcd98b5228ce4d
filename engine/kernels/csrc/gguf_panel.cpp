// Products over GGUF blocks for more than 8 rows (batched decode, prefill).
//
// No float copy of the weight exists: each thread dequantizes a panel of weight rows (the
// exact weights rounded to bf16, gguf::bf16_weights) into a small buffer of its own, row-major
// [panel rows, K], and multiplies every row of x by it while it is in L2; the panel is then
// dropped. Each weight is thus decoded once per chunk of rows of x (kAmxChunkRows, a prefill
// step, on AMX; kRowsPerChunk on the vector path).
// AMX: the panel is decoded into amx_pack_weight's tile layout and x is read row-major, so
// amx::multiply_block (amx_linear.cpp) runs exactly as over a bf16 layer's packed copy. (It
// decoded the panel row-major as the A operand before, which needed x packed per call and each
// 32 x 32 output block transposed back: 1.5-3x the time of the bf16 copy at 512-2048 rows.)
// Without AMX: AVX512-BF16 dot products, 4 x 4 rows at a time.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "kernels.h"
#include "vec.h"
#include "vector_tile.h"

namespace meterserve {
namespace {

constexpr int64_t kRowsPerChunk = 256;  // rows of x multiplied per decoded panel (vector path)

// AMX: rows of x multiplied per decoded panel: a whole prefill step's (the default token
// budget), so each weight is decoded once a step. The chunk's rows of x then stream from L3
// for each panel, which a panel of up to kWidePanelRows weight rows amortizes.
constexpr int64_t kAmxChunkRows = 2048;
constexpr int64_t kWidePanelRows = 128;

// Weight rows per panel for N output columns: up to kWidePanelRows, while every thread still
// gets about four panels (the 135M model's 576-column layers: 64 on 2 threads).
int64_t amx_panel_rows(int64_t N) {
  const int64_t share = N / (4 * omp_get_max_threads()) / 32 * 32;
  return std::clamp<int64_t>(share, 32, kWidePanelRows);
}

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
    int64_t b = 0;
    for (; b + 1 < subs; b += 2) {  // Q4_K: both sub-blocks from one load (bf16_weight_pair)
      __m512bh even, odd;
      gguf::bf16_weight_pair<F>(row, b, scale, min, even, odd);
      _mm512_storeu_si512(dst + b * 32, (__m512i)even);
      _mm512_storeu_si512(dst + b * 32 + 32, (__m512i)odd);
    }
    if (b < subs)
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

constexpr int64_t kPanelRows = 32;          // weight rows per panel: one 32-column output block
constexpr int64_t kTileWeights = 16 * 32;   // bf16 weights per tile (16 rows of 16 pairs)

// Weight rows [n0, n0 + rows) decoded straight into amx_pack_weight's tile layout, the B
// operand amx::multiply_block reads from a bf16 layer's packed copy:
//   tiles[h][kt][r][j][p] = w[n0 + 16 h + j][32 kt + 2 r + p],  rows past `rows` zero.
// Sixteen weight rows' sub-block kt decode to 16 vectors of 16 bf16 pairs, one vector per
// weight row; a 16 x 16 transpose of those 32-bit pairs gives the tile's 16 rows of pairs.
template <class F>
void decode_panel_tiles(const GgufWeight& w, int64_t n0, int64_t rows, bf16* tiles,
                        float* scale, float* min) {
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes, k_tiles = w.K / 32;
  const int64_t groups = w.K / F::kGroup;
  for (int64_t i = 0; i < rows; ++i) {
    const uint8_t* row = w.blocks + (n0 + i) * row_bytes;
    // The same row of the next panel (the thread's next item under static scheduling), so
    // it arrives during this panel's products instead of stalling the next decode.
    prefetch_lines(row + kPanelRows * row_bytes, row_bytes);
    gguf::read_params<F>(row, w.K, scale + i * groups, min + i * groups);
  }
  for (int64_t h = 0; h < kPanelRows / 16; ++h) {
    for (int64_t kt = 0; kt < k_tiles; ++kt) {
      __m512 pairs[16];
      for (int64_t j = 0; j < 16; ++j) {
        const int64_t i = h * 16 + j;
        pairs[j] = i < rows ? _mm512_castsi512_ps((__m512i)gguf::bf16_weights<F>(
                                  w.blocks + (n0 + i) * row_bytes, kt, scale + i * groups,
                                  min + i * groups))
                            : _mm512_setzero_ps();
      }
      transpose_16x16(pairs);
      float* tile = reinterpret_cast<float*>(tiles + (h * k_tiles + kt) * kTileWeights);
      for (int64_t r = 0; r < 16; ++r) _mm512_storeu_ps(tile + r * 16, pairs[r]);
    }
  }
}

// x: [padded_rows, K] row-major, the rows past M zero; the A operand as in amx_linear.
template <class F>
void panel_amx(const bf16* x, int64_t padded_rows, const GgufWeight& w, const bf16* bias,
               bf16* out, int64_t M) {
  const amx::TileConfig config = amx::eight_full_tiles();
  const int64_t groups = w.K / F::kGroup, panel_rows = amx_panel_rows(w.N);
  const int64_t sub_tiles = kPanelRows * w.K;  // one 32-row sub-panel's tile layout
  for (int64_t chunk = 0; chunk < padded_rows; chunk += kAmxChunkRows) {
    const int64_t chunk_end = std::min(padded_rows, chunk + kAmxChunkRows);
#pragma omp parallel
    {
      _tile_loadconfig(&config);  // tile state is per thread
      std::vector<float> scale(kPanelRows * groups), min(kPanelRows * groups);
      std::vector<bf16> tiles(panel_rows * w.K);
      alignas(64) float block[32 * 32];
#pragma omp for schedule(static)
      for (int64_t p0 = 0; p0 < w.N; p0 += panel_rows) {
        const int64_t p_end = std::min(w.N, p0 + panel_rows);
        for (int64_t n0 = p0; n0 < p_end; n0 += kPanelRows)
          decode_panel_tiles<F>(w, n0, std::min(kPanelRows, p_end - n0),
                                tiles.data() + (n0 - p0) / kPanelRows * sub_tiles, scale.data(),
                                min.data());
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += 32) {
          const int64_t rows = std::min<int64_t>(32, M - m0);
          for (int64_t n0 = p0; n0 < p_end; n0 += kPanelRows) {
            amx::multiply_block(x, tiles.data() + (n0 - p0) / kPanelRows * sub_tiles, w.K, m0,
                                0, block);
            const int64_t cols = std::min(kPanelRows, p_end - n0);
            amx::write_block(block, bias, out, w.N, m0, rows, n0, cols);
          }
        }
      }
      _tile_release();
    }
  }
}

#endif  // __AMX_BF16__

constexpr int64_t kVectorPanelRows = 16;

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
          const int64_t rows = std::min<int64_t>(4, chunk_end - m);
          for (int64_t j = 0; j < cols; j += 4)
            vector_tile_rows(xs, rows, panel + j * K, K, bias, dst, w.N, n0 + j,
                             std::min<int64_t>(4, cols - j));
        }
      }
    }
  }
}

}  // namespace

void gguf_panel_linear_amx(const bf16* x, int64_t padded_rows, const GgufWeight& w,
                           const bf16* bias, bf16* out, int64_t M) {
#ifdef __AMX_BF16__
  gguf::dispatch(w.kind, [&](auto format) {
    panel_amx<decltype(format)>(x, padded_rows, w, bias, out, M);
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
