// Matrix-vector products over 4-bit / 8-bit weights as stored in a GGUF file (Q4_1, Q8_0),
// for decode steps of at most 4 rows.
//
// Single-stream decode is bound by the weight bytes each token streams from memory; a Q4_1
// block of 32 weights is 24 bytes here (16 bytes of codes + fp32 scale and min) instead of
// bf16's 64. The weights are repacked at load time (engine/quantized_weights.py): codes
// [N, blocks, 16 or 32], scales and mins fp32 [N, blocks]. Per block b of weight row n:
//   sum_j x[j] * (d q[j] + m) = d * (sum_j x[j] q[j]) + m * (sum_j x[j])
// Q4_1: the 4-bit codes become exact bf16 values (see q4_codes), the dot product is
// AVX512-BF16 (exact products, fp32 sums); the m term uses per-block sums of x computed once
// per call. Q8_0 (no m) converts its int8 codes to fp32.
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
constexpr int kChains = 4;

template <int M>
void q4_1_row(const uint8_t* codes, const float* scales, const float* mins,
              const Activations& a, int64_t blocks, float* out) {
  __m512 acc[M][kChains];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int c) {
    const __m512bh q = q4_codes(codes + b * 16);
    const __m512 d = _mm512_set1_ps(scales[b]);
    for (int m = 0; m < M; ++m) {
      const __m512bh x = (__m512bh)_mm512_loadu_si512(a.x + m * a.K + b * kBlock);
      acc[m][c] = _mm512_fmadd_ps(d, _mm512_dpbf16_ps(_mm512_setzero_ps(), q, x), acc[m][c]);
    }
  };
  int64_t b = 0;
  for (; b + kChains <= blocks; b += kChains)
    for (int c = 0; c < kChains; ++c) step(b + c, c);  // constant c: registers, not memory
  for (; b < blocks; ++b) step(b, 0);
  for (int m = 0; m < M; ++m) {
    const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                       _mm512_add_ps(acc[m][2], acc[m][3]));
    out[m] = _mm512_reduce_add_ps(total) + dot(mins, &a.sums[m * blocks], blocks);
  }
}

template <int M>
void q8_0_row(const uint8_t* codes, const float* scales, const Activations& a, int64_t blocks,
              float* out) {
  __m512 acc[M][kChains];
  for (int m = 0; m < M; ++m)
    for (int c = 0; c < kChains; ++c) acc[m][c] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int c) {
    const __m128i* q = reinterpret_cast<const __m128i*>(codes + b * kBlock);
    const __m512 q_lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q)));
    const __m512 q_hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(q + 1)));
    const __m512 d = _mm512_set1_ps(scales[b]);
    for (int m = 0; m < M; ++m) {
      const float* x = &a.xs[m * a.K + b * kBlock];
      const __m512 dot = _mm512_fmadd_ps(q_hi, _mm512_loadu_ps(x + 16),
                                         _mm512_mul_ps(q_lo, _mm512_loadu_ps(x)));
      acc[m][c] = _mm512_fmadd_ps(d, dot, acc[m][c]);
    }
  };
  int64_t b = 0;
  for (; b + kChains <= blocks; b += kChains)
    for (int c = 0; c < kChains; ++c) step(b + c, c);
  for (; b < blocks; ++b) step(b, 0);
  for (int m = 0; m < M; ++m) {
    const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]),
                                       _mm512_add_ps(acc[m][2], acc[m][3]));
    out[m] = _mm512_reduce_add_ps(total);
  }
}

template <int M>
void quantized_rows(const Activations& a, const QuantizedWeight& w, bf16* out, int64_t N) {
  const int64_t blocks = a.K / kBlock;
  const int64_t code_bytes = w.kind == QuantKind::kQ4_1 ? 16 : 32;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* codes = w.codes + n * blocks * code_bytes;
    float sums[M];
    if (w.kind == QuantKind::kQ4_1)
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
    default: return quantized_rows<4>(a, weight, out, N);
  }
}

}  // namespace meterserve
