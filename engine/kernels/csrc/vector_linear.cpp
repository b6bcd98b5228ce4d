// Products of any number of rows over amx_pack_weight's tile layout with AVX512-BF16 vector
// instructions, for CPUs without AMX (AMD EPYC Zen 4/5): with it such a CPU keeps the same one
// layout as an AMX CPU, read by tile_small_linear for a few rows and here for more. Without it
// a CPU without AMX kept oneDNN's blocked layout, whose one- and two-row products run 0.5-0.8x
// as fast as tile_small_linear's (Zen 4) and which the decode stack cannot read.
//
// A 16-column slice of the weight is one contiguous run of K / 2 64-byte rows, row q holding
// the pair (k = 2 q, 2 q + 1) of each of its 16 columns (see tile_matvec.cpp): so a register
// block of kRows activation rows x kSlices slices loads kSlices weight vectors per pair and
// multiplies each into every row's broadcast pair, 24 fp32 accumulators, one output column per
// lane, no horizontal sums. Each output element is one fp32 sum over k in order, whatever the
// number of rows or the block it falls in: a row's result does not depend on its batch.
//
// Blocking, for the caches: the pairs go in depth blocks of at most kDepth (a block's weight
// for one column block, 3 x 16 x 2,048 x 2 bytes, stays in L2 while the rows pass over it), and
// the rows in chunks whose activations for one depth block stay in L2 too. Each thread takes
// column blocks; between depth blocks a register block's sums wait in fp32 (`partial`) and are
// loaded back, so the sum over k stays one sum in order.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "kernels.h"
#include "vec.h"
#include "vector_linear.h"

namespace meterserve {
namespace {

constexpr int64_t kSliceColumns = 16;
constexpr int kRows = 8;    // activation rows a register block
constexpr int kSlices = 3;  // weight slices a register block: 8 x 3 accumulators
constexpr int64_t kBlockColumns = kSlices * kSliceColumns;
// Depth (k) a block at most, and activation bytes a chunk of rows holds for one depth block
// (Zen 4: 1 MB of L2 a core). Not tuned beyond the shapes in docs/benchmarks.md.
constexpr int64_t kDepth = 2048;
constexpr int64_t kChunkBytes = 512 * 1024;

// Where a register block's sums come from and go: the depth range [k0, k1) it adds, whether it
// starts from zero or from `partial` (an earlier depth block's fp32 sums, kBlockColumns a row),
// and whether it ends in out (+ bias, rounded to bf16) or back in partial.
struct Span {
  int64_t k0, k1;
  bool first, last;
};

// Rows [m0, m0 + R) times slices [n_tile, n_tile + S) over one depth span.
template <int R, int S>
void block(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, float* partial,
           int64_t N, int64_t K, int64_t m0, int64_t n_tile, Span span) {
  const int64_t slice_elements = K * kSliceColumns;
  const bf16* weight = packed + n_tile * slice_elements;
  const bf16* rows = x + m0 * K;
  __m512 acc[R][S];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
      acc[r][s] = span.first ? _mm512_setzero_ps()
                             : _mm512_loadu_ps(partial + r * kBlockColumns + s * kSliceColumns);
  for (int64_t q = span.k0 / 2; q < span.k1 / 2; ++q) {
    __m512bh w[S];
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
      w[s] = (__m512bh)_mm512_loadu_si512(weight + s * slice_elements + q * 2 * kSliceColumns);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      int32_t pair;
      std::memcpy(&pair, rows + r * K + 2 * q, sizeof(pair));
      const __m512bh xs = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) acc[r][s] = _mm512_dpbf16_ps(acc[r][s], xs, w[s]);
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    const int64_t n0 = (n_tile + s) * kSliceColumns;
    if (!span.last) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
        _mm512_storeu_ps(partial + r * kBlockColumns + s * kSliceColumns, acc[r][s]);
      continue;
    }
    const __m512 b = bias ? load(bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) store(out + (m0 + r) * N + n0, _mm512_add_ps(acc[r][s], b));
  }
}

// block<R, S> for the run-time rows (1..kRows) and slices (1..kSlices) of an edge block.
template <int S>
void block_rows(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, float* partial,
                int64_t N, int64_t K, int64_t m0, int64_t rows, int64_t n_tile, Span span) {
  with_small_rows(rows, [&](auto r) {
    block<decltype(r)::value, S>(x, packed, bias, out, partial, N, K, m0, n_tile, span);
  });
}

void any_block(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, float* partial,
               int64_t N, int64_t K, int64_t m0, int64_t rows, int64_t n_tile, int64_t slices,
               Span span) {
  if (rows == kRows && slices == kSlices)
    return block<kRows, kSlices>(x, packed, bias, out, partial, N, K, m0, n_tile, span);
  if (slices == 3)
    return block_rows<3>(x, packed, bias, out, partial, N, K, m0, rows, n_tile, span);
  if (slices == 2)
    return block_rows<2>(x, packed, bias, out, partial, N, K, m0, rows, n_tile, span);
  block_rows<1>(x, packed, bias, out, partial, N, K, m0, rows, n_tile, span);
}

// Even depth blocks of at most kDepth, each a multiple of 32 (K % 32 == 0).
int64_t depth_block(int64_t K) {
  const int64_t depth_blocks = (K + kDepth - 1) / kDepth;
  return (K / 32 + depth_blocks - 1) / depth_blocks * 32;
}

}  // namespace

void vector_slices_rows(const bf16* x, const bf16* packed, bf16* out, int64_t M, int64_t N,
                        int64_t K, int64_t n_tile, int64_t num_slices) {
  const int64_t depth = depth_block(K);
  // Each row block's fp32 sums between depth blocks: only where K > kDepth.
  const int64_t partial_floats = depth < K ? (M + kRows - 1) / kRows * kRows * kBlockColumns : 0;
  std::unique_ptr<float[]> partials(partial_floats ? new float[partial_floats] : nullptr);
  for (int64_t s = 0; s < num_slices; s += kSlices) {
    const int64_t width = std::min<int64_t>(kSlices, num_slices - s);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const Span span{k0, std::min(K, k0 + depth), k0 == 0, k0 + depth >= K};
      for (int64_t m0 = 0; m0 < M; m0 += kRows) {
        float* sums = partials ? partials.get() + m0 * kBlockColumns : nullptr;
        any_block(x, packed, nullptr, out, sums, N, K, m0, std::min<int64_t>(kRows, M - m0),
                  n_tile + s, width, span);
      }
    }
  }
}

void vector_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t M,
                   int64_t N, int64_t K) {
  static_assert(kRows == kSmallBatchRows, "edge blocks dispatch through with_small_rows");
  const int64_t slices = N / kSliceColumns;
  const int64_t column_blocks = (slices + kSlices - 1) / kSlices;
  const int64_t depth = depth_block(K);
  const int64_t chunk_rows =
      std::max<int64_t>(kRows, kChunkBytes / (depth * int64_t(sizeof(bf16))) / kRows * kRows);
  // One register block's fp32 sums per row block of a chunk, per column block, only where
  // K > kDepth: up to chunk_rows x N floats (a 7B's 28,672 x 4,096 gate_up: 128 rows, 14.7 MB),
  // as many rows as M needs (a decode's few: 8), left uninitialized (the first span writes).
  const int64_t partial_rows = std::min(chunk_rows, (M + kRows - 1) / kRows * kRows);
  const int64_t partial_floats =
      depth < K ? partial_rows * column_blocks * kBlockColumns : 0;
  std::unique_ptr<float[]> partials(partial_floats ? new float[partial_floats] : nullptr);
  for (int64_t chunk = 0; chunk < M; chunk += chunk_rows) {
    const int64_t chunk_end = std::min(M, chunk + chunk_rows);
    for (int64_t k0 = 0; k0 < K; k0 += depth) {
      const Span span{k0, std::min(K, k0 + depth), k0 == 0, k0 + depth >= K};
#pragma omp parallel for schedule(static)
      for (int64_t c = 0; c < column_blocks; ++c) {
        const int64_t n_tile = c * kSlices, width = std::min<int64_t>(kSlices, slices - n_tile);
        float* partial = partials ? partials.get() + c * partial_rows * kBlockColumns : nullptr;
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kRows) {
          const int64_t rows = std::min<int64_t>(kRows, chunk_end - m0);
          float* sums = partial ? partial + (m0 - chunk) * kBlockColumns : nullptr;
          any_block(x, packed, bias, out, sums, N, K, m0, rows, n_tile, width, span);
        }
      }
    }
  }
}

}  // namespace meterserve
