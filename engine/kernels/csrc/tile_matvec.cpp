// Matrix-vector products for decode over the AMX tile layout (amx_pack_weight, kernels.h), so
// that an AMX CPU keeps one copy of each bf16 weight: the tiles serve 1-8 rows here and larger
// batches in amx_linear. (The tile product itself streams one row's weight at ~10 GB/s: tile
// loads do not wake the hardware prefetcher; vector loads do.)
//
// A 16-column slice of the weight (n_tile) is one contiguous run of its K / 32 tiles, and
// 64-byte row q of that run holds, for the slice's 16 columns j, the pair (k = 2 q, 2 q + 1):
//   slice[q][j][p] = weight[16 n_tile + j][2 q + p]
// which is vdpbf16ps's operand order against a broadcast activation pair. So each slice is
// streamed front to back once, each 64 bytes multiplied into every input row, and each fp32
// lane accumulates one output column (no horizontal sum). fp32 accumulation in kChains
// interleaved chains per row, rounded once to bf16: the sums are the same as
// small_batch_linear's over a row-major weight up to fp32 summation order.
// For 1-2 rows a thread walks kSlices slices side by side: one sequential stream per thread
// left DRAM bandwidth unused (a 49152 x 2048 head at one row: 19 GB/s against the row-major
// kernel's 27, which reads four weight rows at once).
#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"
#include "tile_matvec.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int64_t kSliceColumns = 16;

template <int M>
constexpr int kSlices = M > 2 ? 1 : 4;
template <int M>
constexpr int kChains = M > 4 ? 2 : (M > 2 ? 4 : 2);  // M x slices x chains registers

// Slices [n_tile, n_tile + S) of the weight, S <= kSlices<M>.
template <int M, int S>
void tile_slices(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t N,
                 int64_t K, int64_t n_tile) {
  constexpr int kC = kChains<M>;
  const int64_t slice_elements = K * kSliceColumns;
  const bf16* slice = packed + n_tile * slice_elements;
  __m512 acc[M][S][kC];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int s = 0; s < S; ++s)
#pragma GCC unroll 4
      for (int c = 0; c < kC; ++c) acc[m][s][c] = _mm512_setzero_ps();
  const int64_t pairs = K / 2;  // a multiple of 16 (K % 32 == 0), so of kC
  for (int64_t q = 0; q < pairs; q += kC) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) {
      __m512 xs[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        int32_t pair;
        std::memcpy(&pair, x + m * K + 2 * (q + c), sizeof(pair));
        xs[m] = _mm512_castsi512_ps(_mm512_set1_epi32(pair));
      }
#pragma GCC unroll 4
      for (int s = 0; s < S; ++s) {
        const __m512bh w = (__m512bh)_mm512_loadu_si512(slice + s * slice_elements +
                                                          (q + c) * 2 * kSliceColumns);
#pragma GCC unroll 8
        for (int m = 0; m < M; ++m)
          acc[m][s][c] = _mm512_dpbf16_ps(acc[m][s][c], (__m512bh)xs[m], w);
      }
    }
  }
#pragma GCC unroll 4
  for (int s = 0; s < S; ++s) {
    const int64_t n0 = (n_tile + s) * kSliceColumns;
    const __m512 b = bias ? load(bias + n0) : _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      __m512 total = acc[m][s][0];
#pragma GCC unroll 4
      for (int c = 1; c < kC; ++c) total = _mm512_add_ps(total, acc[m][s][c]);
      store(out + m * N + n0, _mm512_add_ps(total, b));
    }
  }
}

template <int M>
void tile_rows(const bf16* x, const bf16* packed, const bf16* bias, bf16* out, int64_t N,
               int64_t K) {
  constexpr int kS = kSlices<M>;
  const int64_t slices = N / kSliceColumns, groups = slices / kS;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) tile_slices<M, kS>(x, packed, bias, out, N, K, g * kS);
  for (int64_t n_tile = groups * kS; n_tile < slices; ++n_tile)  // N % 64 slices: N % 32 == 0
    tile_slices<M, 1>(x, packed, bias, out, N, K, n_tile);
}

// Slices [n_tile, n_tile + num_slices) of M rows on this thread, kSlices<M> at a time.
template <int M>
void slices_of_rows(const bf16* x, const bf16* packed, bf16* out, int64_t N, int64_t K,
                    int64_t n_tile, int64_t num_slices) {
  constexpr int kS = kSlices<M>;
  int64_t s = 0;
  for (; s + kS <= num_slices; s += kS)
    tile_slices<M, kS>(x, packed, nullptr, out, N, K, n_tile + s);
  for (; s < num_slices; ++s) tile_slices<M, 1>(x, packed, nullptr, out, N, K, n_tile + s);
}

}  // namespace

void tile_slices_rows(const bf16* x, const bf16* packed, bf16* out, int64_t M, int64_t N,
                      int64_t K, int64_t n_tile, int64_t num_slices) {
  switch (M) {
    case 1: return slices_of_rows<1>(x, packed, out, N, K, n_tile, num_slices);
    case 2: return slices_of_rows<2>(x, packed, out, N, K, n_tile, num_slices);
    case 3: return slices_of_rows<3>(x, packed, out, N, K, n_tile, num_slices);
    case 4: return slices_of_rows<4>(x, packed, out, N, K, n_tile, num_slices);
    case 5: return slices_of_rows<5>(x, packed, out, N, K, n_tile, num_slices);
    case 6: return slices_of_rows<6>(x, packed, out, N, K, n_tile, num_slices);
    case 7: return slices_of_rows<7>(x, packed, out, N, K, n_tile, num_slices);
    default: return slices_of_rows<8>(x, packed, out, N, K, n_tile, num_slices);
  }
}

void tile_small_linear(const bf16* x, const bf16* packed, const bf16* bias, bf16* out,
                       int64_t M, int64_t N, int64_t K) {
  // Without AMX, 3-8 rows go faster through vector_linear's register blocks, three weight
  // streams a thread where tile_rows<3..8> has one (AMD EPYC Zen 4, 1.5B shapes, one thread:
  // 3-4 rows 1.25-1.7x tile_rows on the layers read from memory, 0.8-1.1x on the small ones; 1-2
  // rows 0.6-1.0x). AMX CPUs keep tile_rows, as measured there.
  if (M > 2 && !amx_available()) return vector_linear(x, packed, bias, out, M, N, K);
  switch (M) {
    case 1: return tile_rows<1>(x, packed, bias, out, N, K);
    case 2: return tile_rows<2>(x, packed, bias, out, N, K);
    case 3: return tile_rows<3>(x, packed, bias, out, N, K);
    case 4: return tile_rows<4>(x, packed, bias, out, N, K);
    case 5: return tile_rows<5>(x, packed, bias, out, N, K);
    case 6: return tile_rows<6>(x, packed, bias, out, N, K);
    case 7: return tile_rows<7>(x, packed, bias, out, N, K);
    default: return tile_rows<8>(x, packed, bias, out, N, K);
  }
}

}  // namespace meterserve
