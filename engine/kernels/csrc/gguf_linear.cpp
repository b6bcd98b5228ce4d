// Matrix-vector products over GGUF blocks as stored (gguf_blocks.h), for 1-8 rows: decode.
//
// Single-stream decode is bound by the weight bytes a token streams (Q4_K: 4.5 bits a weight
// against bf16's 16), so each weight row's blocks are read once, decoded in registers and
// multiplied into all M input rows; threads split the weight rows.
// Per weight row: first its scales and mins (K / kGroup of each, K-quants' 6-bit fields
// unpacked), then its 32-weight sub-blocks. With w = scale * q + min per group g:
//   sum_j x[j] w[j] = sum_g scale[g] (sum_{j in g} x[j] q[j]) + min[g] (sum_{j in g} x[j])
// Up to kGgufExactRows input rows (weight-bound), the file's exact weights: unsigned codes
// (< 64) become the exact bf16 numbers 128 + q by OR-ing 0x4300 into them (bf16 has spacing 1
// at 128), so the dot product is AVX512-BF16 (exact products, fp32 sums) and the 128 is taken
// back through the group sums of x computed once per call: the min term uses min - 128 scale.
// Q8_0's signed codes convert to fp32 against an fp32 copy of x instead.
// 5-8 rows: two products per row and sub-block would make the kernel compute-bound, so each
// sub-block is dequantized once to 32 bf16 weights (the exact weight rounded to nearest
// even, what the larger-batch paths multiply) and costs one dot product per row. On AMX CPUs
// gguf_tiles.cpp takes these rows instead: one tile product for all of them.
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

using gguf::sub_block_codes;

struct Activations {
  const bf16* x;            // [M, K] as given
  int64_t K;
  std::vector<float> xf;    // [M, K] fp32 (signed codes only)
  std::vector<float> sums;  // [M, K / kGroup]: sum of x over each scale group
};

template <class F>
Activations prepare(const bf16* x, int64_t M, int64_t K) {
  const int64_t groups = K / F::kGroup;
  Activations a{x, K, {}, std::vector<float>(M * groups)};
  for (int64_t i = 0; i < M * groups; ++i) {
    __m512 sum = load(x + i * F::kGroup);
    if constexpr (F::kGroup == 32) sum = _mm512_add_ps(sum, load(x + i * F::kGroup + 16));
    a.sums[i] = _mm512_reduce_add_ps(sum);
  }
  if constexpr (F::kSigned) {
    a.xf.resize(M * K);
    for (int64_t i = 0; i < M * K; i += kVecLanes) store(&a.xf[i], load(x + i));
  }
  return a;
}

// kChains independent accumulators per input row (one fma chain would stall on its latency);
// above 4 rows the rows themselves are independent chains, and 4 each would not fit the
// 32 registers.
template <int M>
constexpr int kChains = M > 4 ? 2 : 4;

// Sub-block b's scale in each fp32 lane of its dot product: lane i sums elements 2 i, 2 i + 1,
// so with 16-weight groups lanes 0-7 take group 2 b and lanes 8-15 group 2 b + 1.
template <class F>
inline __m512 lane_scales(const float* scale, int64_t b) {
  if constexpr (F::kGroup == 32) {
    return _mm512_set1_ps(scale[b]);
  } else {
    return _mm512_mask_broadcastss_ps(_mm512_set1_ps(scale[2 * b]), 0xFF00,
                                      _mm_load_ss(scale + 2 * b + 1));
  }
}

// 128 + code as exact bf16 (see the top), from F::words: (words & code mask) | 0x4300.
template <class F>
inline __m512bh biased_codes(const uint8_t* row, int64_t b) {
  const __m512i words = F::words(row + (b / gguf::kSubs<F>) * F::kBytes,
                                 static_cast<int>(b % gguf::kSubs<F>));
  return (__m512bh)_mm512_ternarylogic_epi32(words, _mm512_set1_epi16((1 << F::kCodeBits) - 1),
                                             _mm512_set1_epi16(0x4300), 0xEA);  // (a & b) | c
}

// sum_g (min[g] - 128 scale[g]) sums[g]: the min terms, less the codes' +128 bias.
inline float offset_terms(const float* scale, const float* min, const float* sums,
                          int64_t groups) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; g += kVecLanes) {
    const int64_t n = groups - g;
    const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(128.0f), load(scale + g, n),
                                           load(min + g, n));
    acc = _mm512_fmadd_ps(offset, load(sums + g, n), acc);
  }
  return _mm512_reduce_add_ps(acc);
}

template <int M>
using Accumulators = __m512[M][kChains<M>];

// out[m] = the sum over the row's sub-blocks of what add(b, c, acc) adds to the row-m
// accumulators acc[m][c] (c: the sub-block's chain). The accumulators are local here and
// handed to add by argument: captured by a lambda, GCC 12 kept them on the stack.
template <int M, typename Add>
void sum_sub_blocks(int64_t subs, Add&& add, float* out) {
  constexpr int kC = kChains<M>;
  __m512 acc[M][kC];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < subs; b += kC) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) {
      if (b + c >= subs) break;
      add(b + c, c, acc);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    __m512 total = acc[m][0];
#pragma GCC unroll 4
    for (int c = 1; c < kC; ++c) total = _mm512_add_ps(total, acc[m][c]);
    out[m] = _mm512_reduce_add_ps(total);
  }
}

// Sub-block b's dot product with the row-m inputs, added to acc[m] scaled.
template <class F, int M>
inline void add_exact(__m512bh q, __m512 d, const Activations& a, int64_t b, __m512* acc) {
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) {
    const __m512bh x = (__m512bh)_mm512_loadu_si512(a.x + m * a.K + b * 32);
    acc[m] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), q, x), acc[m]);
  }
}

// Sub-block S of super-block blk (K-quants).
template <class F, int M, int S>
inline void exact_sub(const uint8_t* block, int64_t blk, const float* scale,
                      const Activations& a, __m512* chain) {
  const int64_t b = blk * gguf::kSubs<F> + S;
  const __m512bh q = (__m512bh)_mm512_ternarylogic_epi32(
      F::words(block, S), _mm512_set1_epi16((1 << F::kCodeBits) - 1), _mm512_set1_epi16(0x4300),
      0xEA);  // (a & b) | c
  add_exact<F, M>(q, lane_scales<F>(scale, b), a, b, chain);
}

template <class F, int M>
void exact_row(const uint8_t* row, const float* scale, const float* min, const Activations& a,
               float* out) {
  if constexpr (gguf::kSubs<F> == 1) {
    sum_sub_blocks<M>(a.K / 32, [&](int64_t b, int c, Accumulators<M>& acc) {
      __m512 chain[M];
      for (int m = 0; m < M; ++m) chain[m] = acc[m][c];
      add_exact<F, M>(biased_codes<F>(row, b), lane_scales<F>(scale, b), a, b, chain);
      for (int m = 0; m < M; ++m) acc[m][c] = chain[m];
    }, out);
  } else {
    // Super-blocks: their sub-blocks' index known at compile time, so shifts and offsets are
    // constants and sub-blocks sharing code bytes (Q4_K's 2 g and 2 g + 1) load them once.
    constexpr int kC = kChains<M>;
    static_assert(gguf::kSubs<F> == 8 && 8 % kC == 0);
    __m512 acc[kC][M];
    for (int c = 0; c < kC; ++c)
      for (int m = 0; m < M; ++m) acc[c][m] = _mm512_setzero_ps();
    for (int64_t blk = 0; blk < a.K / F::kWeights; ++blk) {
      const uint8_t* block = row + blk * F::kBytes;
      exact_sub<F, M, 0>(block, blk, scale, a, acc[0 % kC]);
      exact_sub<F, M, 1>(block, blk, scale, a, acc[1 % kC]);
      exact_sub<F, M, 2>(block, blk, scale, a, acc[2 % kC]);
      exact_sub<F, M, 3>(block, blk, scale, a, acc[3 % kC]);
      exact_sub<F, M, 4>(block, blk, scale, a, acc[4 % kC]);
      exact_sub<F, M, 5>(block, blk, scale, a, acc[5 % kC]);
      exact_sub<F, M, 6>(block, blk, scale, a, acc[6 % kC]);
      exact_sub<F, M, 7>(block, blk, scale, a, acc[7 % kC]);
    }
    for (int m = 0; m < M; ++m) {
      __m512 total = acc[0][m];
      for (int c = 1; c < kC; ++c) total = _mm512_add_ps(total, acc[c][m]);
      out[m] = _mm512_reduce_add_ps(total);
    }
  }
  const int64_t groups = a.K / F::kGroup;
  for (int m = 0; m < M; ++m) out[m] += offset_terms(scale, min, &a.sums[m * groups], groups);
}

// Signed codes (Q8_0, no min): d * (q . x) in fp32.
template <class F, int M>
void signed_row(const uint8_t* row, const float* scale, const Activations& a, float* out) {
  sum_sub_blocks<M>(a.K / 32, [&](int64_t b, int c, Accumulators<M>& acc) {
    __m512 lo, hi;
    gguf::codes_f32<F>(sub_block_codes<F>(row, b), lo, hi);
    const __m512 d = _mm512_set1_ps(scale[b]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float* x = &a.xf[m * a.K + b * 32];
      const __m512 dot = _mm512_fmadd_ps(hi, _mm512_loadu_ps(x + 16),
                                         _mm512_mul_ps(lo, _mm512_loadu_ps(x)));
      acc[m][c] = _mm512_fmadd_ps(d, dot, acc[m][c]);
    }
  }, out);
}

// Rows > kGgufExactRows: each sub-block's bf16 weights, one dot product per input row.
template <class F, int M>
void rounded_row(const uint8_t* row, const float* scale, const float* min,
                 const Activations& a, float* out) {
  sum_sub_blocks<M>(a.K / 32, [&](int64_t b, int c, Accumulators<M>& acc) {
    const __m512bh w = gguf::bf16_weights<F>(row, b, scale, min);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      acc[m][c] = _mm512_dpbf16_ps(acc[m][c], w,
                                   (__m512bh)_mm512_loadu_si512(a.x + m * a.K + b * 32));
  }, out);
}

// How far ahead of the row being multiplied its thread prefetches the blocks. Each thread
// walks its rows in order, and at 1-8 rows the arithmetic per byte is small, so without it a
// thread waits on DRAM between rows (measured on a 2-core AMX Xeon, 58 MB of Q4_1 blocks, one
// row: 8.9-9.4 GB/s without, 12-14.5 GB/s with 2-3 KB ahead into L1; nearer helped less, 6 KB
// no more). Two stages: into L2 kL2PrefetchBytes ahead, then into L1 kPrefetchBytes ahead (12
// of the 1.5B's layers from memory, one row, alternated with L1 alone: Q4_K 1.10-1.24x, Q4_1
// 1.13-1.21x, Q6_K 1.03-1.08x; 4-12 KB ahead measured alike, 24 KB less). Not for Q8_0, which
// streams near the machine's bandwidth with L1 alone (0.86-0.95x with both). Each row fetches
// one row's worth, so the distances stay constant.
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kL2PrefetchBytes = 4096;

template <class F, int M>
void small_row(const Activations& a, const GgufWeight& w, const bf16* bias, bf16* out,
               int64_t n, float* scale, float* min) {
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes;
  const uint8_t* row = w.blocks + n * row_bytes;
  if constexpr (!F::kSigned) prefetch_lines_l2(row + kL2PrefetchBytes, row_bytes);
  prefetch_lines(row + kPrefetchBytes, row_bytes);
  gguf::read_params<F>(row, w.K, scale, min);
  float sums[M];
  if constexpr (M > kGgufExactRows)
    rounded_row<F, M>(row, scale, min, a, sums);
  else if constexpr (F::kSigned)
    signed_row<F, M>(row, scale, a, sums);
  else
    exact_row<F, M>(row, scale, min, a, sums);
  const float b = bias ? to_float(bias[n]) : 0.0f;
  for (int m = 0; m < M; ++m) out[m * w.N + n] = from_float<bf16>(sums[m] + b);
}

template <class F, int M>
void small_rows(const Activations& a, const GgufWeight& w, const bf16* bias, bf16* out) {
  const int64_t groups = w.K / F::kGroup;
#pragma omp parallel
  {
    std::vector<float> scale(groups), min(groups);
    each_row_in_streams(w.N, [&](int64_t n) {
      small_row<F, M>(a, w, bias, out, n, scale.data(), min.data());
    });
  }
}

}  // namespace

int64_t gguf_row_bytes(int kind, int64_t K) {
  if (!gguf::supported(kind)) return 0;
  return gguf::dispatch(kind, [&](auto format) -> int64_t {
    using F = decltype(format);
    return K > 0 && K % F::kWeights == 0 ? K / F::kWeights * F::kBytes : 0;
  });
}

void gguf_small_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                       int64_t M, bool use_amx) {
  if (w.int8_activations) return gguf_int8_linear(x, w, bias, out, M);
  if (M > kGgufExactRows && use_amx && amx_available())
    return gguf_tile_linear(x, w, bias, out, M);
  gguf::dispatch(w.kind, [&](auto format) {
    using F = decltype(format);
    const Activations a = prepare<F>(x, M, w.K);
    with_small_rows(M, [&](auto rows) { small_rows<F, decltype(rows)::value>(a, w, bias, out); });
  });
}

void gguf_linear_rows(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out, int64_t M,
                      bool use_amx, int64_t small_rows) {
  const bool amx = use_amx && amx_available();
  if (M <= std::min<int64_t>(small_rows, kSmallBatchRows)) {
    gguf_small_linear(x, w, bias, out, M, use_amx);
  } else if (amx && M <= kGgufWideTileRows) {
    gguf_tile_linear(x, w, bias, out, M);
  } else if (amx) {
    // x padded to whole 32-row blocks (the A operand, row-major as amx_linear reads it).
    const int64_t padded_rows = (M + 31) / 32 * 32;
    std::vector<bf16> padded;
    const bf16* rows = x;
    if (padded_rows != M) {
      padded.assign(padded_rows * w.K, bf16{0});
      std::copy(x, x + M * w.K, padded.begin());
      rows = padded.data();
    }
    gguf_panel_linear_amx(rows, padded_rows, w, bias, out, M);
  } else {
    gguf_panel_linear_vector(x, w, bias, out, M);
  }
}

}  // namespace meterserve
