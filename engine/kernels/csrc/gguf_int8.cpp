// GGUF matrix-vector products with int8 inputs, for 1-8 rows (gguf_linear.h): the
// small-batch path of EngineConfig.gguf_activations "int8".
//
// The exact path (gguf_linear.cpp) spends a one-row K-quant token on arithmetic more than on
// bytes: per 32 weights a widening, a shift, a bias OR, a bf16 dot product and an fp32 scale
// multiply-add, and each row's scales unpacked to fp32 first. Quantizing the inputs to int8
// (as llama.cpp does for its quantized matvecs) turns the products into integer multiply-adds
// on the stored codes: for the K-quants a 64-byte load gives 128 4-bit codes, u8 x s8 pairs
// (vpmaddubsw) then each sub-block's 6-bit scale (vpdpwssd) add into int32 lanes exactly,
// and a super-block costs one fp32 multiply-add per row; the 32-weight formats sum two blocks'
// products a register (vpdpbusd) and scale them in fp32 per block.
//
// Inputs: each block of the format's weights (256 for the K-quants, as llama.cpp's Q8_K; 32
// for the others) of a row as dx * xq, dx = max |x| / 127, xq = round(x / dx) (nearest even).
// Per row, super-block (K-quants) or block (others):
//   Q4_K, Q5_K:  dx (d sum_s sc[s] (q_s . xq_s) - dmin sum_s m[s] sum(xq_s))   s: 32 inputs
//   Q6_K:        dx d sum_g sc[g] (q_g . xq_g - 32 sum(xq_g))                    g: 16 inputs
//   others:      dx (d (q . xq) + m sum(xq))  (m: the stored min, or -8 d, -16 d; Q8_0's
//                signed codes + 128 as u8, with m = -128 d)
// The integer sums are exact; the result differs from the exact weights' product by the
// inputs' rounding only: engine/gguf_blocks.py's int8_inputs is the reference.
#include <immintrin.h>
#include <omp.h>

#include <cstring>
#include <vector>

#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

using gguf::half;
using gguf::u32;

// Inputs sharing one int8 scale: a super-block of the K-quants (256), a block of the others
// (32: their rows need not hold whole 256s, and each block has its own fp32 scale anyway).
template <class F>
constexpr int64_t kInputGroup = F::kWeights;
constexpr int64_t kSuper = 256;

// The inputs quantized per kInputGroup: q in the order the format's kernel reads a super-block's
// 64-byte registers, sums over 16 consecutive inputs in natural order.
// 32-weight formats: rows padded with zeros to whole pairs of blocks (stride), and per pair of
// blocks b, b + 1 32 floats: dx[b] x 8, dx[b + 1] x 8, then dx sum(xq) of b in lane 0, of
// b + 1 in lane 8, zeros (block32_row's per-lane factors).
struct Int8Inputs {
  int64_t K, stride;
  std::vector<int8_t> q;       // [M, stride]
  std::vector<float> scale;    // [M, K / kInputGroup]
  std::vector<int16_t> sums;   // [M, stride / 16]
  std::vector<float> pair_scale;  // [M, stride / 64, 32] (32-weight formats)
};

// Q4_K and Q5_K read sub-blocks (0, 2), (1, 3), (4, 6), (5, 7): a 64-byte load of their codes
// holds two 32-byte runs whose low nibbles are sub-blocks 2j, 2j + 2 and high nibbles 2j + 1,
// 2j + 3.
constexpr int kQ4KOrder[8] = {0, 2, 1, 3, 4, 6, 5, 7};
constexpr int kNaturalOrder[8] = {0, 1, 2, 3, 4, 5, 6, 7};

// One group of 16 * n16 inputs: scale = max |x| / 127, q = round(x * 127 / max), nearest even
// (0 and scale 0 when all are 0). Sub-block s (32 inputs) goes to position order[s].
void quantize_group(const bf16* x, int n16, const int* order, int8_t* q, float* scale,
                    int16_t* sums) {
  __m512 v[16];
  __m512 amax = _mm512_setzero_ps();
  for (int i = 0; i < n16; ++i) {
    v[i] = load(x + 16 * i);
    amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
  }
  const float max = _mm512_reduce_max_ps(amax);
  const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
  *scale = max / 127.0f;
  for (int i = 0; i < n16; ++i) {
    const __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(q + 32 * order[i / 2] + 16 * (i % 2)),
                     _mm512_cvtsepi32_epi8(codes));
    sums[i] = static_cast<int16_t>(_mm512_reduce_add_epi32(codes));
  }
}

// pair_scale from the quantized rows.
void fill_pair_scales(Int8Inputs& a, int64_t M) {
  const int64_t blocks = a.K / 32, pairs = a.stride / 64;
  a.pair_scale.assign(M * pairs * 32, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      float* lanes = &a.pair_scale[(m * pairs + b / 2) * 32 + 8 * (b % 2)];
      const float dx = a.scale[m * blocks + b];
      const int16_t* sums = &a.sums[m * a.stride / 16 + 2 * b];
      for (int i = 0; i < 8; ++i) lanes[i] = dx;
      lanes[16] = dx * static_cast<float>(sums[0] + sums[1]);
    }
}

template <class F>
Int8Inputs quantize_inputs(const bf16* x, int64_t M, int64_t K) {
  constexpr int64_t G = kInputGroup<F>;
  const int64_t stride = G == 32 ? (K + 63) / 64 * 64 : K;
  Int8Inputs a{K, stride, std::vector<int8_t>(M * stride), std::vector<float>(M * K / G),
               std::vector<int16_t>(M * stride / 16), {}};
  const bool paired = std::is_same_v<F, gguf::Q4_K> || std::is_same_v<F, gguf::Q5_K>;
  const int* order = paired ? kQ4KOrder : kNaturalOrder;
  for (int64_t m = 0; m < M; ++m)
    for (int64_t j = 0; j < K / G; ++j)
      quantize_group(x + m * K + j * G, G / 16, order, &a.q[m * stride + j * G],
                     &a.scale[m * K / G + j], &a.sums[(m * stride + j * G) / 16]);
  if constexpr (G == 32) fill_pair_scales(a, M);
  return a;
}

inline __m512i load64(const void* p) { return _mm512_loadu_si512(p); }

// The word permutation giving each maddubs output word (inputs 2w, 2w + 1 of a 64-input
// register) its scale: element w of the result is scales[index[w]].
inline __m512i spread(__m512i scales, __m512i index) {
  return _mm512_permutexvar_epi16(index, scales);
}

// Index vectors for spread, from word iota: words 0-15 take scale a, 16-31 scale b (32 inputs
// a scale, Q4_K), or words 8 i .. 8 i + 7 scale first + i (16 inputs a scale, Q6_K).
alignas(64) constexpr int16_t kWordIota[32] = {0,  1,  2,  3,  4,  5,  6,  7,  8,  9,  10,
                                               11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
                                               22, 23, 24, 25, 26, 27, 28, 29, 30, 31};
inline __m512i halves(int a, int b) {
  return _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(static_cast<short>(a)),
                                 _mm512_set1_epi16(static_cast<short>(b)));
}
inline __m512i quarters(int first) {
  return _mm512_add_epi16(_mm512_srli_epi16(_mm512_load_si512(kWordIota), 3),
                          _mm512_set1_epi16(static_cast<short>(first)));
}

// Q4_K's and Q5_K's 8 scales and 8 mins (6 bits each) as words 0-7 and 8-15 (k_params's bit operations).
inline __m256i k_scales_mins(const uint8_t* b) {
  const uint32_t lo = u32(b + 4), mid = u32(b + 8), hi = u32(b + 12);
  const uint32_t sc_lo = lo & 0x3F3F3F3F, m_lo = mid & 0x3F3F3F3F;
  const uint32_t sc_hi = (hi & 0x0F0F0F0F) | ((lo >> 2) & 0x30303030);
  const uint32_t m_hi = ((hi >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030);
  return _mm256_cvtepu8_epi16(_mm_setr_epi32(sc_lo, sc_hi, m_lo, m_hi));
}

// The fifth bits of Q5_K sub-blocks a (bytes 0-31 of a register) and b (32-63): bits a and b
// of the 32 qh bytes.
inline __mmask64 fifth_bits(__m512i qh, int a, int b) {
  const __m512i bit = _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull,
                                             _mm512_set1_epi8(static_cast<char>(1 << a)),
                                             _mm512_set1_epi8(static_cast<char>(1 << b)));
  return _mm512_test_epi8_mask(qh, bit);
}

// Row m's integer products with a super-block's four code vectors w (u8), each pair of
// products scaled by its sub-block's scale (sc, spread per lane): 16 int32 sums.
inline __m512i scaled_dots(const __m512i* w, const __m512i* sc, const Int8Inputs& a, int m,
                           int64_t j) {
  const int8_t* xq = &a.q[m * a.K + j * kSuper];
  __m512i dots = _mm512_setzero_si512();
#pragma GCC unroll 4
  for (int r = 0; r < 4; ++r)
    dots = _mm512_dpwssd_epi32(dots, _mm512_maddubs_epi16(w[r], load64(xq + 64 * r)), sc[r]);
  return dots;
}

// Row m's sixteen 16-input sums of super-block j.
inline __m256i input_sums(const Int8Inputs& a, int m, int64_t j) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(&a.sums[(m * a.K + j * kSuper) / 16]));
}

// Q4_K and Q5_K (F::kCodeBits 4, 5): 6-bit scales and mins per 32 inputs.
template <class F, int M>
void k_row(const uint8_t* row, const Int8Inputs& a, float* out) {
  constexpr bool kFifth = F::kCodeBits == 5;
  constexpr int kCodesAt = kFifth ? 48 : 16;
  const __m512i idx[4] = {halves(0, 2), halves(1, 3), halves(4, 6), halves(5, 7)};
  // Each min m[s] twice, against the two 16-input sums of sub-block s.
  const __m256i min_idx = _mm256_setr_epi16(8, 8, 9, 9, 10, 10, 11, 11, 12, 12, 13, 13, 14, 14,
                                            15, 15);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = a.K / kSuper;
  for (int64_t j = 0; j < blocks; ++j) {
    const uint8_t* block = row + j * F::kBytes;
    const __m256i params = k_scales_mins(block);
    const __m512i params512 = _mm512_castsi256_si512(params);
    const __m256i mins = _mm256_permutexvar_epi16(min_idx, params);
    const float d = half(block), dmin = half(block + 2);
    const __m512i c0 = load64(block + kCodesAt), c1 = load64(block + kCodesAt + 64);
    __m512i w[4] = {_mm512_and_si512(c0, low_nibbles),
                    _mm512_and_si512(_mm512_srli_epi16(c0, 4), low_nibbles),
                    _mm512_and_si512(c1, low_nibbles),
                    _mm512_and_si512(_mm512_srli_epi16(c1, 4), low_nibbles)};
    if constexpr (kFifth) {
      const __m512i qh = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 16)));
      const __m512i sixteen = _mm512_set1_epi8(0x10);
      for (int r = 0; r < 4; ++r)
        w[r] = _mm512_mask_add_epi8(w[r], fifth_bits(qh, kQ4KOrder[2 * r], kQ4KOrder[2 * r + 1]),
                                    w[r], sixteen);
    }
    __m512i sc[4];
    for (int r = 0; r < 4; ++r) sc[r] = spread(params512, idx[r]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i dots = scaled_dots(w, sc, a, m, j);
      const __m256i min_terms = _mm256_madd_epi16(mins, input_sums(a, m, j));
      const float dx = a.scale[m * blocks + j];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots), _mm512_set1_ps(d * dx), acc[m]);
      acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(_mm512_zextsi256_si512(min_terms)),
                                _mm512_set1_ps(dmin * dx), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <int M>
void q6k_row(const uint8_t* row, const Int8Inputs& a, float* out) {
  const __m512i idx[4] = {quarters(0), quarters(4), quarters(8), quarters(12)};
  // Where a register's codes take their two high bits from qh: sub-blocks 4 h, 4 h + 1 bits 0-1
  // and 2-3 (moved up to bits 4-5), 4 h + 2, 4 h + 3 bits 4-5 and 6-7 (moved down).
  const __m512i up = halves(4, 2), down = halves(0, 2);
  const __m512i low_nibbles = _mm512_set1_epi8(0x0F), high_bits = _mm512_set1_epi8(0x30);
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  const int64_t blocks = a.K / kSuper;
  for (int64_t j = 0; j < blocks; ++j) {
    const uint8_t* block = row + j * gguf::Q6_K::kBytes;
    const __m256i scales =
        _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192)));
    const __m512i scales512 = _mm512_castsi256_si512(scales);
    const float d = half(block + 208);
    __m512i w[4];
    for (int h = 0; h < 2; ++h) {
      const __m512i low = load64(block + 64 * h);
      const __m512i high = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + 128 + 32 * h)));
      w[2 * h] = _mm512_ternarylogic_epi32(_mm512_sllv_epi16(high, up), high_bits,
                                           _mm512_and_si512(low, low_nibbles), 0xEA);
      w[2 * h + 1] = _mm512_ternarylogic_epi32(
          _mm512_srlv_epi16(high, down), high_bits,
          _mm512_and_si512(_mm512_srli_epi16(low, 4), low_nibbles), 0xEA);  // (a & b) | c
    }
    __m512i sc[4];
    for (int r = 0; r < 4; ++r) sc[r] = spread(scales512, idx[r]);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      // The codes' bias 32: 32 sum_g sc[g] sum(xq_g).
      const __m256i bias = _mm256_slli_epi32(_mm256_madd_epi16(scales, input_sums(a, m, j)), 5);
      const __m512i dots =
          _mm512_sub_epi32(scaled_dots(w, sc, a, m, j), _mm512_zextsi256_si512(bias));
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dots),
                               _mm512_set1_ps(d * a.scale[m * blocks + j]), acc[m]);
    }
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// Blocks b and b + 1's codes as u8, one register: Q8_0's 32 + 32 signed codes + 128; the
// 4-bit formats' 16 code bytes of each block broadcast to two 128-bit lanes, the second lane's
// shifted down a nibble (its elements 16-31), masked; Q5's fifth bits added as 16.
template <class F>
inline __m512i pair_codes(const uint8_t* block) {
  if constexpr (F::kSigned) {
    const __m512i both = _mm512_inserti64x4(_mm512_castsi256_si512(gguf::load32(block + 2)),
                                            gguf::load32(block + F::kBytes + 2), 1);
    return _mm512_xor_si512(both, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    auto lanes = [](const uint8_t* b) {
      return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b)));
    };
    const __m512i both = _mm512_mask_blend_epi64(0xF0, lanes(block + F::kCodesAt),
                                                 lanes(block + F::kBytes + F::kCodesAt));
    const __m512i codes = _mm512_and_si512(_mm512_mask_srli_epi16(both, 0xFF00FF00u, both, 4),
                                           _mm512_set1_epi8(0x0F));
    if constexpr (F::kFifthAt < 0) return codes;
    const __mmask64 fifth = gguf::u32(block + F::kFifthAt) |
                            (uint64_t{gguf::u32(block + F::kBytes + F::kFifthAt)} << 32);
    return _mm512_mask_add_epi8(codes, fifth, codes, _mm512_set1_epi8(0x10));
  }
}

// Blocks b and b + 1's fp16 d (words 0-7, 8-15) and m (16-23, 24-31; formats with one) from
// the pair's first 64 bytes (masked: a pair of the smallest blocks is 36).
template <class F>
inline __m512i pair_heads(const uint8_t* block) {
  constexpr int kNext = F::kBytes / 2;  // block b + 1's first word
  constexpr int kM = F::kMinAt / 2;
  const __m512i index = _mm512_inserti64x4(
      _mm512_castsi256_si512(_mm256_inserti128_si256(
          _mm256_castsi128_si256(_mm_set1_epi16(0)), _mm_set1_epi16(kNext), 1)),
      _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(kM < 0 ? 0 : kM)),
                              _mm_set1_epi16(kM < 0 ? 0 : kNext + kM), 1),
      1);
  constexpr int kPairBytes = 2 * F::kBytes < 64 ? 2 * F::kBytes : 64;
  const __m512i head = _mm512_maskz_loadu_epi8(~0ull >> (64 - kPairBytes), block);
  return _mm512_permutexvar_epi16(index, head);
}

// 32-weight blocks (Q4_0 ... Q8_0): two blocks' codes a register (pair_codes), u8 x s8
// products summed in int32 by vpdpbusd; per pair and row, d times the inputs' scales (both in
// 8 lanes a block, Int8Inputs.pair_scale) and the min terms m sum(x) (m: the stored m, or
// -kMinCodes d; Q8_0's +128 adds -128 d).
template <class F>
inline void pair_terms(const uint8_t* block, __m512i& codes, __m512& d, __m512& min) {
  codes = pair_codes<F>(block);
  const __m512i heads = pair_heads<F>(block);
  d = _mm512_cvtph_ps(_mm512_castsi512_si256(heads));
  constexpr float kMinFactor = -static_cast<float>(F::kMinCodes) - (F::kSigned ? 128.0f : 0.0f);
  if constexpr (F::kMinAt >= 0)
    min = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(heads, 1));
  else
    min = _mm512_mul_ps(d, _mm512_set1_ps(kMinFactor));
}

template <class F, int M>
void block32_row(const uint8_t* row, const Int8Inputs& a, float* out) {
  const int64_t blocks = a.K / 32, pairs = (blocks + 1) / 2;
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  auto add = [&](const uint8_t* block, int64_t p) {
    __m512i codes;
    __m512 d, min;
    pair_terms<F>(block, codes, d, min);
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m) {
      const __m512i dot = _mm512_dpbusd_epi32(_mm512_setzero_si512(), codes,
                                              load64(&a.q[m * a.stride + p * 64]));
      const float* x = &a.pair_scale[(m * pairs + p) * 32];
      acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(d, _mm512_loadu_ps(x)),
                               acc[m]);
      acc[m] = _mm512_fmadd_ps(min, _mm512_loadu_ps(x + 16), acc[m]);
    }
  };
  for (int64_t p = 0; p < blocks / 2; ++p) add(row + 2 * p * F::kBytes, p);
  if (blocks % 2) {  // the last block alone, beside a zero one (d = m = 0), read from a copy
    uint8_t last[2 * F::kBytes] = {};
    std::memcpy(last, row + (blocks - 1) * F::kBytes, F::kBytes);
    add(last, blocks / 2);
  }
  for (int m = 0; m < M; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

template <class F, int M>
void int8_row(const uint8_t* row, const Int8Inputs& a, float* out) {
  if constexpr (std::is_same_v<F, gguf::Q6_K>) {
    q6k_row<M>(row, a, out);
  } else if constexpr (F::kWeights == kSuper) {
    k_row<F, M>(row, a, out);
  } else {
    block32_row<F, M>(row, a, out);
  }
}

// Threads and prefetching as gguf_linear.cpp's small_rows. The K-quants go without software
// prefetch here: fewer instructions a byte than the exact path leave the hardware prefetcher
// enough (12 of the 1.5B's layers from memory, one row, alternated 20 times on a 2-core AMD
// EPYC Zen 4: Q4_K 1.10x, Q6_K 1.06x without); the 32-weight formats keep it (Q4_0 1.5x with).
constexpr int64_t kPrefetchBytes = 2048;
constexpr int64_t kL2PrefetchBytes = 4096;
template <class F>
constexpr bool kPrefetch = F::kWeights == 32;

template <class F, int M>
void int8_rows(const Int8Inputs& a, const GgufWeight& w, const bf16* bias, bf16* out) {
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes;
#pragma omp parallel
  each_row_in_streams(w.N, [&](int64_t n) {
    const uint8_t* row = w.blocks + n * row_bytes;
    if constexpr (kPrefetch<F>) {
      prefetch_lines_l2(row + kL2PrefetchBytes, row_bytes);
      prefetch_lines(row + kPrefetchBytes, row_bytes);
    }
    float sums[M];
    int8_row<F, M>(row, a, sums);
    const float b = bias ? to_float(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) out[m * w.N + n] = from_float<bf16>(sums[m] + b);
  });
}

template <class F>
void int8_linear_of(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out, int64_t M) {
  const Int8Inputs a = quantize_inputs<F>(x, M, w.K);
  with_small_rows(M, [&](auto rows) { int8_rows<F, decltype(rows)::value>(a, w, bias, out); });
}

}  // namespace

void gguf_int8_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                      int64_t M) {
  gguf::dispatch(w.kind, [&](auto format) {
    int8_linear_of<decltype(format)>(x, w, bias, out, M);
  });
}

}  // namespace meterserve
