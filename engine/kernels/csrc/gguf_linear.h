// Products with weights held as ggml blocks, exactly as stored in a GGUF file (gguf_blocks.h).
//
//   out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]),  w = the blocks' weights (gguf-py's values)
//
// x bf16 [M, K] row-major; the weight is N rows of row_bytes(kind, K) bytes; out bf16 [M, N].
// Which weights each path multiplies (the reference each is tested against):
//   M <= kExactRows:  the exact float32 weights (fp32 sums);
//   larger M:         the weights rounded to bf16, as a bf16 checkpoint's would be.
#pragma once

#include <omp.h>

#include <cstdint>

#include "numeric.h"

namespace meterserve {

struct GgufWeight {
  int kind;               // ggml type id (gguf::Kind)
  const uint8_t* blocks;  // [N, row_bytes]
  int64_t N, K;
  // gguf_small_linear quantizes the inputs to int8 and multiplies the codes by them
  // (gguf_int8.cpp) instead of multiplying the exact weights.
  bool int8_activations = false;
};

// Up to this many rows the small-batch path multiplies the exact weights (gguf_linear.cpp).
constexpr int64_t kGgufExactRows = 4;

// How the small-batch paths (exact and int8) walk a weight's N rows, called inside a parallel
// region: each thread takes a contiguous share and walks kGgufStreams parts of it side by side,
// a row of each in turn, calling row(n). One sequential stream per thread left DRAM bandwidth
// unused (tile_matvec.cpp found the same for bf16). 12 of the 1.5B's layers from memory, one
// row: two streams against one, alternated, Q4_K 1.12-1.17x, the other formats 0.97-1.19x;
// four streams 1.02-1.27x in one sweep; 2, 3 and 4 streams measured alike.
constexpr int64_t kGgufStreams = 4;

template <class Fn>
void each_row_in_streams(int64_t N, Fn&& row) {
  const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
  const int64_t begin = N * t / threads, end = N * (t + 1) / threads;
  const int64_t part = (end - begin + kGgufStreams - 1) / kGgufStreams;
  for (int64_t i = 0; i < part; ++i)
    for (int64_t s = 0; s < kGgufStreams; ++s) {
      const int64_t n = begin + s * part + i;
      if (n < end) row(n);
    }
}

// Bytes of one weight row of K weights; 0 if kind is unsupported or K is not whole blocks.
int64_t gguf_row_bytes(int kind, int64_t K);

// The tile path (gguf_tiles.cpp) takes up to this many rows.
constexpr int64_t kGgufTileRows = 32;
// gguf_tile_linear also takes up to this many rows (three or four B tiles per A tile).
constexpr int64_t kGgufWideTileRows = 64;

// M <= kSmallBatchRows (8): streams the blocks once for all rows, decoding as it goes. Above
// kGgufExactRows rows, with use_amx on a CPU with AMX, gguf_tile_linear instead; with
// w.int8_activations, gguf_int8_linear at every M.
void gguf_small_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                       int64_t M, bool use_amx = true);

// 1 <= M <= kSmallBatchRows, the inputs quantized to int8 (per 256 for the K-quants, per 32
// for the others; gguf_int8.cpp): the codes' products with them are exact integers, so the
// result differs from the exact weights' by the inputs' rounding only.
void gguf_int8_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                      int64_t M);

// 1 <= M <= kGgufWideTileRows, AMX only: each sub-block dequantized to bf16 once and multiplied
// into every row by one tile product; per row equal to gguf_panel_linear_amx's sums.
void gguf_tile_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                      int64_t M);

// Any M, on AMX tiles: x is [padded_rows, K] row-major, padded with zero rows to padded_rows
// (a multiple of 32). Each thread dequantizes 32 weight rows at a time into amx_pack_weight's
// tile layout and multiplies them into every row of x (gguf_panel.cpp).
void gguf_panel_linear_amx(const bf16* x, int64_t padded_rows, const GgufWeight& w,
                           const bf16* bias, bf16* out, int64_t M);

// Any M >= 1: the path gguf_linear takes for M rows (gguf_binding.cpp): up to small_rows
// (at most kSmallBatchRows) gguf_small_linear, then on AMX (use_amx) the tiles up to
// kGgufWideTileRows and the AMX panels above, else the AVX512-BF16 panels.
void gguf_linear_rows(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out, int64_t M,
                      bool use_amx, int64_t small_rows);

// Any M, AVX512-BF16 dot products over the same dequantized panels (CPUs without AMX).
void gguf_panel_linear_vector(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                              int64_t M);

}  // namespace meterserve
