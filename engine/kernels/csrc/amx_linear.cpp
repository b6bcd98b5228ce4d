// bf16 matrix multiply on AMX tiles, for batches of more than 4 rows (batched decode, prefill).
//
// oneDNN reaches only 0.4-0.7 TFLOP/s on this model's small layers (N, K of a few hundred) at
// decode batch sizes; the AMX units do a 16x16x32 bf16 tile product per instruction.
// The weight is packed once (amx_pack_weight layout, see kernels.h) so that each 16-column x
// 32-deep slice is one contiguous 1 KB tile in AMX's pair-interleaved ("VNNI") form:
//   packed[n_tile][k_tile][r][j][p] = weight[16 n_tile + j][32 k_tile + 2 r + p]
// out[m, n] = sum_k x[m, k] weight[n, k] (+ bias[n]), fp32 accumulation, rounded once to bf16.
//
// Blocking: 32 x 32 output blocks held in four accumulator tiles (2 x 2), so each loaded
// A (activation) and B (weight) tile feeds two tile products. Rows go in chunks that keep
// their activations in L2; within a chunk the threads split the 32-column blocks.
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "tile_matvec.h"
#include "vec.h"

namespace meterserve {

#ifdef __AMX_BF16__

namespace {

constexpr int64_t kTileRows = 16, kTileDepth = 32;  // bf16 elements per tile row
constexpr int64_t kBlock = 32;                        // output rows / cols per 2x2 block
constexpr int64_t kRowsPerChunk = 256;                 // activation rows kept hot in L2
constexpr int64_t kTileElements = kTileRows * kTileDepth;

// Weight tiles are streamed from memory once per block; tile loads do not seem to wake the
// hardware prefetcher the way vector loads do, so fetch the tiles ahead (measured: batch-64
// decode matmuls 40 -> 33 ms per step at 4 tiles into L1). 16 tiles ahead into L2 streams
// better still on a 2-core AMX Xeon (a MoE layer's 8 experts of 1024 x 1024 at 1 row: 5.7 ->
// 9.7 GB/s, at 8 rows 9.3 -> 12.2; dense shapes 8-64 rows: within noise to +45%).
constexpr int64_t kPrefetchTiles = 16;

inline void prefetch_tile(const bf16* tile) {
  prefetch_lines_l2(tile, kTileElements * sizeof(bf16));
}

}  // namespace

void amx::write_block(const float* block, const bf16* bias, bf16* out, int64_t N, int64_t m0,
                      int64_t rows, int64_t n0, int64_t cols) {
  const int64_t lo = std::min<int64_t>(cols, kVecLanes), hi = cols - lo;
  const __m512 bias_lo = bias ? load(bias + n0, lo) : _mm512_setzero_ps();
  const __m512 bias_hi = bias && hi ? load(bias + n0 + kVecLanes, hi) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r) {
    bf16* dst = out + (m0 + r) * N + n0;
    store(dst, _mm512_add_ps(_mm512_load_ps(block + r * kBlock), bias_lo), lo);
    if (hi)
      store(dst + kVecLanes, _mm512_add_ps(_mm512_load_ps(block + r * kBlock + kVecLanes), bias_hi),
            hi);
  }
}

amx::TileConfig amx::eight_full_tiles() {
  amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = kTileRows;
  return config;
}

// One 32 x 32 output block: rows [m0, m0 + 32) of x (padded), columns [n0, n0 + 32).
// Tiles: 0-3 accumulators (row half i, column half j -> 2 i + j), 4-5 x, 6-7 weight.
void amx::multiply_block(const bf16* x, const bf16* packed, int64_t K, int64_t m0, int64_t n0,
                         float* block) {
  const int64_t k_tiles = K / kTileDepth;
  const bf16* weight0 = packed + (n0 / kTileRows) * k_tiles * kTileElements;
  const bf16* weight1 = weight0 + k_tiles * kTileElements;
  const int64_t x_stride = K * sizeof(bf16);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    // Past the end of weight0 lies weight1, past weight1 the next block's weight0 (the
    // threads take consecutive blocks); a prefetch past the whole weight is a harmless hint.
    prefetch_tile(weight0 + (kt + kPrefetchTiles) * kTileElements);
    prefetch_tile(weight1 + (kt + kPrefetchTiles) * kTileElements);
    _tile_loadd(4, x + m0 * K + kt * kTileDepth, x_stride);
    _tile_loadd(5, x + (m0 + kTileRows) * K + kt * kTileDepth, x_stride);
    _tile_loadd(6, weight0 + kt * kTileElements, 64);
    _tile_loadd(7, weight1 + kt * kTileElements, 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t stride = kBlock * sizeof(float);
  _tile_stored(0, block, stride);
  _tile_stored(1, block + kTileRows, stride);
  _tile_stored(2, block + kTileRows * kBlock, stride);
  _tile_stored(3, block + kTileRows * kBlock + kTileRows, stride);
}

namespace {

// Groups of one or two rows take the vector small-batch product over the same tiles
// (tile_matvec.cpp), four 16-column slices side by side per item of kVectorColumns. Measured
// on a 2-core AMX Xeon, 1,024 x 1,024 experts, alternated runs: 1 row x 8 experts 0.57-0.88
// ms against 0.70-0.87 on the tiles, 2 rows x 64 experts 6.2-6.5 against 6.9-7.5; from 3
// rows on the tiles are as fast, at 4 the one-slice vector product was 1.4x slower. These
// rows sum in another order than the tiles', so they may differ from amx_linear's in the
// last bit.
constexpr int64_t kVectorRows = 2;
constexpr int64_t kVectorColumns = 64;

// Groups of 3-16 rows (a batch-64 decode step over 64 experts, top-8: ~8 rows each) fill one A
// tile, so they take 16 x 64 blocks: one x tile against four weight slices, four weight
// streams per thread where the 32 x 32 block has two and half its x rows empty.
// Each output element accumulates the same tile products in the same order as in
// multiply_block, so these rows equal amx_linear's bit for bit.
constexpr int64_t kWideRows = kTileRows, kWideColumns = 64;

// Rows [m0, m0 + 16) of x (padded) times columns [n0, n0 + 64): columns [n0, n0 + 32) into
// left, [n0 + 32, n0 + 64) into right, each 16 rows of kBlock floats. Tiles: 0-3 accumulators
// (a 16-column quarter each), 4 x, 5-7 weight (the fourth quarter reloads 5).
void multiply_wide_block(const bf16* x, const bf16* packed, int64_t K, int64_t m0, int64_t n0,
                         float* left, float* right) {
  const int64_t k_tiles = K / kTileDepth, slice = k_tiles * kTileElements;
  const bf16* w0 = packed + (n0 / kTileRows) * slice;
  const bf16 *w1 = w0 + slice, *w2 = w1 + slice, *w3 = w2 + slice;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int64_t ahead = (kt + kPrefetchTiles) * kTileElements, at = kt * kTileElements;
    prefetch_tile(w0 + ahead);
    prefetch_tile(w1 + ahead);
    prefetch_tile(w2 + ahead);
    prefetch_tile(w3 + ahead);
    _tile_loadd(4, x + m0 * K + kt * kTileDepth, K * sizeof(bf16));
    _tile_loadd(5, w0 + at, 64);
    _tile_loadd(6, w1 + at, 64);
    _tile_loadd(7, w2 + at, 64);
    _tile_dpbf16ps(0, 4, 5);
    _tile_dpbf16ps(1, 4, 6);
    _tile_dpbf16ps(2, 4, 7);
    _tile_loadd(5, w3 + at, 64);
    _tile_dpbf16ps(3, 4, 5);
  }
  const int64_t stride = kBlock * sizeof(float);
  _tile_stored(0, left, stride);
  _tile_stored(1, left + kTileRows, stride);
  _tile_stored(2, right, stride);
  _tile_stored(3, right + kTileRows, stride);
}

}  // namespace

bool amx_available() { return amx::permitted(); }

void amx_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t M,
                int64_t padded_rows, int64_t N, int64_t K) {
  const amx::TileConfig config = amx::eight_full_tiles();
  for (int64_t chunk = 0; chunk < padded_rows; chunk += kRowsPerChunk) {
    const int64_t chunk_end = std::min(padded_rows, chunk + kRowsPerChunk);
#pragma omp parallel
    {
      _tile_loadconfig(&config);  // tile state is per thread
      alignas(64) float block[kBlock * kBlock];
#pragma omp for schedule(static)
      for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kBlock) {
          amx::multiply_block(x, packed, K, m0, n0, block);
          amx::write_block(block, bias, out, N, m0, std::min(kBlock, M - m0), n0, kBlock);
        }
      }
      _tile_release();
    }
  }
}

void amx_grouped_linear(const bf16* x, const bf16* packed, const int64_t* groups,
                        int64_t num_groups, bf16* out, int64_t N, int64_t K) {
  // Work items (group, column block, row block), column blocks of one group in order so each
  // thread's static share streams consecutive weight tiles; a group's row blocks share a
  // column block's tiles from L1. A group of few rows is one row block, vector or wide.
  enum class Kind { kVector, kWide, kBlock };
  struct Item {
    const bf16* weight;
    int64_t m0, rows, n0;
    Kind kind;
  };
  std::vector<Item> items;
  const int64_t expert_elements = N * K;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t expert = groups[3 * g], first = groups[3 * g + 1], count = groups[3 * g + 2];
    const bf16* weight = packed + expert * expert_elements;
    if (count == 0) continue;
    if (count <= kVectorRows || (count <= kWideRows && N % kWideColumns == 0)) {
      const bool vector = count <= kVectorRows;
      const int64_t step = vector ? kVectorColumns : kWideColumns;
      for (int64_t n0 = 0; n0 < N; n0 += step)
        items.push_back({weight, first, count, n0, vector ? Kind::kVector : Kind::kWide});
      continue;
    }
    for (int64_t n0 = 0; n0 < N; n0 += kBlock)
      for (int64_t m0 = first; m0 < first + count; m0 += kBlock)
        items.push_back({weight, m0, std::min(kBlock, first + count - m0), n0, Kind::kBlock});
  }
  const amx::TileConfig config = amx::eight_full_tiles();
  const int64_t num_items = static_cast<int64_t>(items.size());
#pragma omp parallel
  {
    _tile_loadconfig(&config);
    alignas(64) float block[kBlock * kBlock];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < num_items; ++i) {
      const Item& item = items[i];
      if (item.kind == Kind::kVector) {
        const int64_t slices = std::min(kVectorColumns, N - item.n0) / kTileRows;
        tile_slices_rows(x + item.m0 * K, item.weight, out + item.m0 * N, item.rows, N, K,
                         item.n0 / kTileRows, slices);
      } else if (item.kind == Kind::kWide) {
        float* right = block + kTileRows * kBlock;
        multiply_wide_block(x, item.weight, K, item.m0, item.n0, block, right);
        amx::write_block(block, nullptr, out, N, item.m0, item.rows, item.n0, kBlock);
        amx::write_block(right, nullptr, out, N, item.m0, item.rows, item.n0 + kBlock, kBlock);
      } else {
        amx::multiply_block(x, item.weight, K, item.m0, item.n0, block);
        amx::write_block(block, nullptr, out, N, item.m0, item.rows, item.n0, kBlock);
      }
    }
    _tile_release();
  }
}

#else  // a compiler or CPU without AMX: the binding sees amx_available() false

bool amx_available() { return false; }

void amx_linear(const bf16*, const bf16*, const bf16*, bf16*, int64_t, int64_t, int64_t, int64_t) {
  throw std::runtime_error("amx_linear: built without AMX support");
}

void amx_grouped_linear(const bf16*, const bf16*, const int64_t*, int64_t, bf16*, int64_t,
                        int64_t) {
  throw std::runtime_error("amx_grouped_linear: built without AMX support");
}

#endif  // __AMX_BF16__

}  // namespace meterserve
