// Matrix-vector products over 4-bit / 8-bit weights as stored in a GGUF file (Q4_1, Q8_0),
// for decode steps of at most 8 rows.
//
// Single-stream decode is bound by the weight bytes each token streams from memory; a Q4_1
// block of 32 weights is 24 bytes here (16 bytes of codes + fp32 scale and min) instead of
// bf16's 64. The weights are repacked at load time (engine/quantized_weights.py): codes
// [N, blocks, 16 or 32], scales and mins fp32 [N, blocks]. Per block b of weight row n:
//   sum_j x[j] * (d q[j] + m) = d * (sum_j x[j] q[j]) + m * (sum_j x[j])
// Up to kExactRows input rows (single-stream decode, weight-bound): Q4_1's 4-bit codes become
// exact bf16 values (see q4_codes), the dot product is AVX512-BF16 (exact products, fp32 sums)
// and the m term uses per-block sums of x computed once per call; Q8_0 (no m) converts its
// int8 codes to fp32. So these rows multiply the file's exact weights.
// More rows (5-8): there the two products per row and block above make the kernel
// compute-bound (measured: 8 rows of a 3,072 x 576 Q4_1 weight took 2.2x oneDNN's bf16 time
// from cache). Each block is instead dequantized once to 32 bf16 weights, d q + m rounded to
// bf16 as the large-batch path's weights are, and each row costs one dot product per block.
#include <immintrin.h>

#include <vector>

#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int64_t kBlock = 32;

struct Activations {
  const bf16* x;               // [M, K] as given
  std::vector<float> xs;       // [M, K] fp32 (Q8_0 path)
  std::vector<float> sums;     // [M, K / 32]: sum of each block of x (Q4_1 m term)
  int64_t K;
};

Activations prepare(const bf16* x, int64_t M, int64_t K) {
  Activations a{x, std::vector<float>(M * K), std::vector<float>(M * K / kBlock), K};
  for (int64_t i = 0; i < M * K; ++i) a.xs[i] = to_float(x[i]);
  for (int64_t i = 0; i < M * K / kBlock; ++i) {
    const __m512 pair = _mm512_add_ps(_mm512_loadu_ps(&a.xs[i * kBlock]),
                                      _mm512_loadu_ps(&a.xs[i * kBlock + 16]));
    a.sums[i] = _mm512_reduce_add_ps(pair);
  }
  return a;
}

// Codes of one Q4_1 block (16 bytes: q[j] low nibble of byte j, q[j + 16] high nibble) as 32
// bf16 values 128 + q[j], in element order. The bf16 bit pattern 0x43XX is 128 + XX for XX < 128
// (the spacing of bf16 at 128 is 1), so one OR turns a code into a number: no lookup, and a
// single cross-lane shuffle (the byte -> word widening) per block. The +128 is taken back
// through the mins (repack stores m - 128 d), since d (128 + q) + m - 128 d = d q + m.
inline __m512bh q4_codes(const uint8_t* codes) {
  const __m256i both = _mm256_broadcastsi128_si256(
      _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes)));
  const __m256i nibbles = _mm256_and_si256(
      _mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0), _mm256_set1_epi8(0x0F));
  return (__m512bh)_mm512_or_si512(_mm512_cvtepu8_epi16(nibbles), _mm512_set1_epi16(0x4300));
}

// sum_b a[b] * b_[b] over `count` floats (the Q4_1 m terms of one row).
inline float dot(const float* a, const float* b, int64_t count) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t i = 0; i < count; i += kVecLanes)
    acc = _mm512_fmadd_ps(load(a + i, count - i), load(b + i, count - i), acc);
  return _mm512_reduce_add_ps(acc);
}

// kChains independent accumulators per input row: one fma chain would stall on its latency.
// Above 4 rows the rows themselves are independent chains, and 4 each would not fit the
// 32 registers.
template <int M>
constexpr int kChains = M > 4 ? 2 : 4;

template <int M>
__m512 sum_chains(const __m512 (&acc)[kChains<M>]) {
  __m512 total = acc[0];
  for (int c = 1; c < kChains<M>; ++c) total = _mm512_add_ps(total, acc[c]);
  return total;
}

// out[m] = the sum over blocks of one weight row of what add_block(b, c, acc) adds to the
// row-m accumulators acc[m][c] (c: the block's chain). Plain unrolled loops, the accumulator
// array local here and handed to add_block by argument: when a lambda captured it instead,
// GCC 12 kept the accumulators on the stack, storing and reloading them every few blocks
// (8 rows of a 3,072 x 576 Q4_1 weight from cache: 122 -> 106 us; 4 rows 66 -> 53 us).
template <int M, typename AddBlock>
void sum_blocks(int64_t blocks, AddBlock&& add_block, float* out) {
  constexpr int kC = kChains<M>;
  __m512 acc[M][kC];
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b += kC) {
#pragma GCC unroll 4
    for (int c = 0; c < kC; ++c) {
      if (b + c >= blocks) break;
      add_block(b + c, c, acc);
    }
  }
#pragma GCC unroll 8
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(sum_chains<M>(acc[m]));
}

template <int M>
using Accumulators = __m512[M][kChains<M>];

template <int M>
void q4_1_row(const uint8_t* codes, const float* scales, const float* mins,
              const Activations& a, int64_t blocks, float* out) {
  sum_blocks<M>(blocks, [&](int64_t b, int c, Accumulators<M>& acc) {
    const __m512bh q = q4_codes(codes + b * 16);
    const __m512 d = _mm512_set1_ps(scales[b]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(a.x + m * a.K + b * kBlock);
      acc[m][c] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), q, x), acc[m][c]);
    }
  }, out);
  for (int m = 0; m < M; ++m) out[m] += dot(mins, &a.sums[m * blocks], blocks);
}

template <int M>
void q8_0_row(const uint8_t* codes, const float* scales, const Activations& a, int64_t blocks,
              float* out) {
  sum_blocks<M>(blocks, [&](int64_t b, int c, Accumulators<M>& acc) {
    const __m128i* q = reinterpret_cast<const __m128i*>(codes + b * kBlock);
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    const __m512 d = _mm512_set1_ps(scales[b]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const float* x = &a.xs[m * a.K + b * kBlock];
      const __m512 dot = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(x + 16),
                                         _mm512_mul_ps(q_lo, _mm512_loadu_ps(x)));
      acc[m][c] = _mm512_fmadd_ps(d, dot, acc[m][c]);
    }
  }, out);
}

// Rows above this count multiply bf16-rounded weights (see the top).
constexpr int kExactRows = 4;

// A block's 32 weights from two fp32 halves (lo: elements 0-15), rounded to nearest even.
inline __m512bh to_bf16(__m512 lo, __m512 hi) { return _mm512_cvtne2ps_pbh(hi, lo); }

// One Q4_1 block as bf16 weights d (128 + q) + (m - 128 d), in element order.
inline __m512bh q4_weights(const uint8_t* codes, float scale, float min) {
  const __m512i words = (__m512i)q4_codes(codes);  // bf16 128 + q: fp32 is the bits << 16
  const __m512 lo = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(words)), 16));
  const __m512 hi = _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(words, 1)), 16));
  const __m512 d = _mm512_set1_ps(scale), m = _mm512_set1_ps(min);
  return to_bf16(_mm512_fmadd_ps(d, lo, m), _mm512_fmadd_ps(d, hi, m));
}

// One Q8_0 block as bf16 weights d q.
inline __m512bh q8_weights(const uint8_t* codes, float scale) {
  const __m128i* q = reinterpret_cast<const __m128i*>(codes);
  const __m512 d = _mm512_set1_ps(scale);
  const __m512 lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
  const __m512 hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
  return to_bf16(_mm512_mul_ps(d, lo), _mm512_mul_ps(d, hi));
}

// Rows > kExactRows: each block's bf16 weights, one dot product per input row.
template <int M>
void bf16_weight_row(const uint8_t* codes, int64_t code_bytes, const float* scales,
                     const float* mins, const Activations& a, int64_t blocks, float* out) {
  sum_blocks<M>(blocks, [&](int64_t b, int c, Accumulators<M>& acc) {
    const uint8_t* block = codes + b * code_bytes;
    const __m512bh w = mins ? q4_weights(block, scales[b], mins[b]) : q8_weights(block, scales[b]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
      acc[m][c] = _mm512_dpbf16_ps(acc[m][c], w,
                                   (__m512bh)_mm512_loadu_si512(a.x + m * a.K + b * kBlock));
  }, out);
}

template <int M>
void quantized_rows(const Activations& a, const QuantizedWeight& w, bf16* out, int64_t N) {
  const int64_t blocks = a.K / kBlock;
  const bool q4 = w.kind == QuantKind::kQ4_1;
  const int64_t code_bytes = q4 ? 16 : 32;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* codes = w.codes + n * blocks * code_bytes;
    float sums[M];
    if constexpr (M > kExactRows)
      bf16_weight_row<M>(codes, code_bytes, w.scales + n * blocks,
                         q4 ? w.mins + n * blocks : nullptr, a, blocks, sums);
    else if (q4)
      q4_1_row<M>(codes, w.scales + n * blocks, w.mins + n * blocks, a, blocks, sums);
    else
      q8_0_row<M>(codes, w.scales + n * blocks, a, blocks, sums);
    for (int m = 0; m < M; ++m) out[m * N + n] = from_float<bf16>(sums[m]);
  }
}

}  // namespace

void quantized_linear(const bf16* x, const QuantizedWeight& weight, bf16* out, int64_t M,
                      int64_t N, int64_t K) {
  const Activations a = prepare(x, M, K);
  switch (M) {
    case 1: return quantized_rows<1>(a, weight, out, N);
    case 2: return quantized_rows<2>(a, weight, out, N);
    case 3: return quantized_rows<3>(a, weight, out, N);
    case 4: return quantized_rows<4>(a, weight, out, N);
    case 5: return quantized_rows<5>(a, weight, out, N);
    case 6: return quantized_rows<6>(a, weight, out, N);
    case 7: return quantized_rows<7>(a, weight, out, N);
    default: return quantized_rows<8>(a, weight, out, N);
  }
}

}  // namespace meterserve
