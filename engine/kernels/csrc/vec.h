// 16-lane float vectors (AVX-512) over float or bf16 memory, with torch's rounding.
//
// load() widens to fp32, store() rounds to the element type (nearest even, as torch does),
// round() rounds in a register without storing. `count` variants touch only the first
// `count` (< 16) elements, for row tails.
#pragma once

#include <immintrin.h>

#include "numeric.h"

namespace meterserve {

constexpr int kVecLanes = 16;

// Every cache line of [p, p + bytes) into the cache level `hint` names (a hint: past a
// tensor's end it is harmless, nothing faults).
template <int hint>
inline void prefetch_range(const void* p, int64_t bytes) {
  const char* start = static_cast<const char*>(p);
  for (int64_t line = 0; line < bytes; line += 64)
    _mm_prefetch(start + line, static_cast<decltype(_MM_HINT_T0)>(hint));
}

// Into L1 ahead of use: the GGUF kernels fetch blocks a thread will read next.
inline void prefetch_lines(const void* p, int64_t bytes) { prefetch_range<_MM_HINT_T0>(p, bytes); }

// Into L2 only: further ahead, where L2's larger count of outstanding misses lets a thread keep
// more of DRAM's latency in flight than L1's fill buffers do.
inline void prefetch_lines_l2(const void* p, int64_t bytes) {
  prefetch_range<_MM_HINT_T1>(p, bytes);
}

inline __mmask16 lanes(int64_t count) {
  return count >= kVecLanes ? __mmask16(0xFFFF) : __mmask16((1u << count) - 1);
}

inline __m512 load(const float* p, int64_t count = kVecLanes) {
  return _mm512_maskz_loadu_ps(lanes(count), p);
}

inline __m512 load(const bf16* p, int64_t count = kVecLanes) {
  const __m256i half = _mm256_maskz_loadu_epi16(lanes(count), p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// Round-to-nearest-even to bf16 precision, result still in fp32 lanes (low 16 bits zero).
// NaNs are not special-cased: activations here never hold them.
inline __m512i bf16_rounded_bits(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7FFF));
  return _mm512_and_si512(_mm512_add_epi32(bits, bias), _mm512_set1_epi32(int(0xFFFF0000)));
}

template <typename T>
inline __m512 round(__m512 v);

template <>
inline __m512 round<float>(__m512 v) {
  return v;
}

template <>
inline __m512 round<bf16>(__m512 v) {
  return _mm512_castsi512_ps(bf16_rounded_bits(v));
}

inline void store(float* p, __m512 v, int64_t count = kVecLanes) {
  _mm512_mask_storeu_ps(p, lanes(count), v);
}

// v's 16 lanes rounded to bf16, as 16 words.
inline __m256i bf16_words(__m512 v) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(bf16_rounded_bits(v), 16));
}

inline void store(bf16* p, __m512 v, int64_t count = kVecLanes) {
  _mm256_mask_storeu_epi16(p, lanes(count), bf16_words(v));
}

// r[i][j] -> r[j][i] for a 16 x 16 fp32 matrix held in 16 registers: pairs of rows interleave
// (unpack), then 2 x 2 and 4 x 4 groups of 128-bit lanes are exchanged (shuffle, shuffle_f32x4),
// 64 shuffles in all and no memory access.
inline void transpose_16x16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int i = 0; i < 16; i += 8)
    for (int j = 0; j < 4; ++j) {
      t[i + j] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0x88);
      t[i + j + 4] = _mm512_shuffle_f32x4(r[i + j], r[i + j + 4], 0xDD);
    }
  for (int j = 0; j < 8; ++j) {
    r[j] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0x88);
    r[j + 8] = _mm512_shuffle_f32x4(t[j], t[j + 8], 0xDD);
  }
}

// r[i] = the sum of a[i]'s 16 lanes, for 16 vectors at once: adjacent vectors' lanes are
// interleaved and added (unpack), halving the vectors at each of four levels; each sum's
// order of adds is fixed, whatever the other vectors hold.
inline __m512 sum_each_of_16(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)  // b[i]: a[2i] in elements 0, 2 of each 128-bit lane, a[2i+1] 1, 3
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // c[i]: a[4i + e]'s lane partial sums in element e of each lane
    const __m512d lo = _mm512_castps_pd(b[2 * i]), hi = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(lo, hi)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(lo, hi)));
  }
  // Lanes added in pairs twice: c[0..3]'s four lanes -> one lane each, in order.
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88),
                                  _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88),
                                  _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// e^x to ~1 ulp: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (remainder < 2e-7 relative), times 2^n.
inline __m512 exp(__m512 x) {
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.7f)), _mm512_set1_ps(-87.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace meterserve
