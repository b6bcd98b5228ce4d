// ggml block formats as the GGUF kernels read them, straight from the file's bytes.
//
// engine/gguf_blocks.py documents each layout and holds the plain-torch reference. Here every
// format is a traits struct F:
//   kWeights, kBytes   weights and bytes per block (32 or 256 weights);
//   kGroup             weights sharing one scale: 32, or 16 for Q6_K;
//   kSigned            codes are int8 (Q8_0) rather than unsigned 0-63;
//   params(block, scale, min)  (256-weight formats) for each group g of the block
//                      (kWeights / kGroup of them): w = scale[g] * code + min[g], which
//                      float32 fma computes exactly as gguf-py does (its products are exact,
//                      its one add rounds once); read_params gives them for a whole row;
//   codes(block, s)    the 32 codes of the block's s-th 32-weight sub-block, one byte each,
//                      in element order;
//   words(block, s)    (unsigned formats) the same codes one per 16-bit word, element order,
//                      valid in the low kCodeBits bits (higher bits may hold anything): the
//                      decode kernels' cheaper form, masked where it is used.
// 32-weight formats also give kMinAt, the byte offset of their fp16 m (-1: none) and kMinCodes
// (min = -kMinCodes d without m); read_params reads their d and m 16 blocks at a time; kCodesAt
// and kFifthAt, the byte offsets of their codes and of Q5's 32 fifth bits (-1: none).
// A row of K weights is K / 32 sub-blocks; sub-block b lies in block b / kSubs<F>.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>

namespace meterserve {
namespace gguf {

enum Kind : int {
  kQ4_0 = 2,
  kQ4_1 = 3,
  kQ5_0 = 6,
  kQ5_1 = 7,
  kQ8_0 = 8,
  kQ4_K = 12,
  kQ5_K = 13,
  kQ6_K = 14,
};

inline float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

inline uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// 16 bytes of packed nibbles -> 32 codes: low nibbles are elements 0-15, high ones 16-31.
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0),
                          _mm256_set1_epi8(0x0F));
}

// codes | 16 where bit j of `bits` is set (the fifth bit of Q5 codes).
inline __m256i with_fifth_bit(__m256i codes, __mmask32 bits) {
  return _mm256_mask_add_epi8(codes, bits, codes, _mm256_set1_epi8(0x10));  // codes < 16
}

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 32 bytes widened to 32 words.
inline __m512i widen32(const uint8_t* p) { return _mm512_cvtepu8_epi16(load32(p)); }

// 16 bytes of packed nibbles -> 32 words: elements 0-15 byte j (low nibble valid), 16-31
// byte j >> 4.
inline __m512i nibble_words(const uint8_t* qs) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m512i shifts = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(4), 1);
  return _mm512_srlv_epi16(_mm512_cvtepu8_epi16(both), shifts);
}

// Q5's fifth bit: words & 15, | 16 where bit j of `bits` is set.
inline __m512i with_fifth_bit_words(__m512i words, __mmask32 bits) {
  const __m512i low = _mm512_and_si512(words, _mm512_set1_epi16(0x0F));
  return _mm512_mask_add_epi16(low, bits, low, _mm512_set1_epi16(0x10));
}

inline __m512i shift_words(__m512i v, int count) {
  return _mm512_srl_epi16(v, _mm_cvtsi32_si128(count));
}

// Bytes >> count within each byte, count < 8 (16-bit shift; the mask drops what crossed).
inline __m256i shift_bytes(__m256i v, int count, int keep) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(count)), _mm256_set1_epi8(keep));
}

struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18, kGroup = 32, kCodeBits = 4;
  static constexpr int kMinAt = -1, kMinCodes = 8;
  static constexpr int kCodesAt = 2, kFifthAt = -1;
  static constexpr bool kSigned = false;
  static __m256i codes(const uint8_t* b, int) { return nibbles(b + 2); }
  static __m512i words(const uint8_t* b, int) { return nibble_words(b + 2); }
};

struct Q4_1 {
  static constexpr int kWeights = 32, kBytes = 20, kGroup = 32, kCodeBits = 4;
  static constexpr int kMinAt = 2, kMinCodes = 0;
  static constexpr int kCodesAt = 4, kFifthAt = -1;
  static constexpr bool kSigned = false;
  static __m256i codes(const uint8_t* b, int) { return nibbles(b + 4); }
  static __m512i words(const uint8_t* b, int) { return nibble_words(b + 4); }
};

struct Q5_0 {
  static constexpr int kWeights = 32, kBytes = 22, kGroup = 32, kCodeBits = 5;
  static constexpr int kMinAt = -1, kMinCodes = 16;
  static constexpr int kCodesAt = 6, kFifthAt = 2;
  static constexpr bool kSigned = false;
  static __m256i codes(const uint8_t* b, int) { return with_fifth_bit(nibbles(b + 6), u32(b + 2)); }
  static __m512i words(const uint8_t* b, int) {
    return with_fifth_bit_words(nibble_words(b + 6), u32(b + 2));
  }
};

struct Q5_1 {
  static constexpr int kWeights = 32, kBytes = 24, kGroup = 32, kCodeBits = 5;
  static constexpr int kMinAt = 2, kMinCodes = 0;
  static constexpr int kCodesAt = 8, kFifthAt = 4;
  static constexpr bool kSigned = false;
  static __m256i codes(const uint8_t* b, int) { return with_fifth_bit(nibbles(b + 8), u32(b + 4)); }
  static __m512i words(const uint8_t* b, int) {
    return with_fifth_bit_words(nibble_words(b + 8), u32(b + 4));
  }
};

struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34, kGroup = 32, kCodeBits = 8;
  static constexpr int kMinAt = -1, kMinCodes = 0;
  static constexpr int kCodesAt = 2, kFifthAt = -1;
  static constexpr bool kSigned = true;
  static __m256i codes(const uint8_t* b, int) { return load32(b + 2); }
};

// Q4_K / Q5_K super-block scales: 8 6-bit scales and mins from 12 bytes (gguf_blocks.py's
// _k_scales), 4 at a time as packed bytes, then scale = d sc, min = -dmin m (exact products).
inline void k_params(const uint8_t* b, float* scale, float* min) {
  const uint32_t lo = u32(b + 4), mid = u32(b + 8), hi = u32(b + 12);
  const uint32_t sc_lo = lo & 0x3F3F3F3F, m_lo = mid & 0x3F3F3F3F;
  const uint32_t sc_hi = (hi & 0x0F0F0F0F) | ((lo >> 2) & 0x30303030);
  const uint32_t m_hi = ((hi >> 4) & 0x0F0F0F0F) | ((mid >> 2) & 0x30303030);
  const __m128i packed = _mm_setr_epi32(sc_lo, sc_hi, m_lo, m_hi);
  const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(packed));
  const __m512 factors = _mm512_insertf32x8(_mm512_set1_ps(half(b)),
                                            _mm256_set1_ps(-half(b + 2)), 1);
  const __m512 both = _mm512_mul_ps(values, factors);
  _mm256_storeu_ps(scale, _mm512_castps512_ps256(both));
  _mm256_storeu_ps(min, _mm512_extractf32x8_ps(both, 1));
}

// Block j's 16 scale and min codes (bytes of lane j of `packed`) times its factors: the
// d and -dmin of block j, lanes 2 j and 2 j + 1 of `factors`.
template <int J>
inline void k_block_params(__m512i packed, __m512 factors, float* scale, float* min) {
  const __m512 values =
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(packed, J)));
  const __m512i which = _mm512_inserti64x4(_mm512_set1_epi32(2 * J),
                                           _mm256_set1_epi32(2 * J + 1), 1);
  const __m512 both = _mm512_mul_ps(values, _mm512_permutexvar_ps(which, factors));
  _mm256_storeu_ps(scale + 8 * J, _mm512_castps512_ps256(both));
  _mm256_storeu_ps(min + 8 * J, _mm512_extractf32x8_ps(both, 1));
}

// k_params for 4 blocks `stride` bytes apart, the same bit operations on the 4 blocks' first
// 16 bytes in the 4 lanes of one register (the scalar version, with its moves from general
// registers to vectors, took 25-30 % of a one-row Q4_K matvec at K = 2048). Each lane's
// dwords are [d | dmin, lo, mid, hi]; the 16 bytes become k_params's [sc_lo, sc_hi, m_lo,
// m_hi], and the same products give the same bits.
inline void k_params4(const uint8_t* b, int64_t stride, float* scale, float* min) {
  auto lane = [&](int j) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + j * stride)); };
  __m512i v = _mm512_castsi128_si512(lane(0));
  v = _mm512_inserti32x4(v, lane(1), 1);
  v = _mm512_inserti32x4(v, lane(2), 2);
  v = _mm512_inserti32x4(v, lane(3), 3);
  // [lo, hi, mid, hi >> 4] & [3F, 0F, 3F, 0F] | ([lo, lo, mid, mid] >> 2) & [0, 30, 0, 30]
  const __m512i low = _mm512_srlv_epi32(_mm512_shuffle_epi32(v, _MM_PERM_DCDB),
                                        _mm512_set4_epi32(4, 0, 0, 0));
  const __m512i high = _mm512_and_si512(
      _mm512_srli_epi32(_mm512_shuffle_epi32(v, _MM_PERM_CCBB), 2),
      _mm512_set4_epi32(0x30303030, 0, 0x30303030, 0));
  const __m512i packed = _mm512_ternarylogic_epi32(
      low, _mm512_set4_epi32(0x0F0F0F0F, 0x3F3F3F3F, 0x0F0F0F0F, 0x3F3F3F3F), high,
      0xEA);  // (a & b) | c
  // [d0, -dmin0, d1, -dmin1, ...]: dword 0 of each lane, its two halves widened.
  const __m512i heads = _mm512_permutexvar_epi32(
      _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0), v);
  const __m256 halves = _mm256_xor_ps(_mm256_cvtph_ps(_mm512_castsi512_si128(heads)),
                                      _mm256_castsi256_ps(_mm256_set1_epi64x(1ll << 63)));
  const __m512 factors = _mm512_zextps256_ps512(halves);
  k_block_params<0>(packed, factors, scale, min);
  k_block_params<1>(packed, factors, scale, min);
  k_block_params<2>(packed, factors, scale, min);
  k_block_params<3>(packed, factors, scale, min);
}

struct Q4_K {
  static constexpr int kWeights = 256, kBytes = 144, kGroup = 32, kCodeBits = 4;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* scale, float* min) { k_params(b, scale, min); }
  static void params4(const uint8_t* b, float* scale, float* min) {
    k_params4(b, kBytes, scale, min);
  }
  static __m256i codes(const uint8_t* b, int s) {
    return shift_bytes(load32(b + 16 + 32 * (s / 2)), 4 * (s % 2), 0x0F);
  }
  static __m512i words(const uint8_t* b, int s) {
    return shift_words(pair_bytes(b, s & ~1), 4 * (s % 2));
  }
  // The 32 bytes, widened to words, whose low nibbles are sub-block s (even) and whose high
  // nibbles are sub-block s + 1.
  static __m512i pair_bytes(const uint8_t* b, int s) { return widen32(b + 16 + 16 * s); }
};

// Q5_K: bit s of qh[l] (bytes 16-47) is the fifth bit of element l of sub-block s.
inline __mmask32 fifth_bits(const uint8_t* b, int s) {
  return _mm256_test_epi8_mask(load32(b + 16), _mm256_set1_epi8(static_cast<char>(1 << s)));
}

struct Q5_K {
  static constexpr int kWeights = 256, kBytes = 176, kGroup = 32, kCodeBits = 5;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* scale, float* min) { k_params(b, scale, min); }
  static void params4(const uint8_t* b, float* scale, float* min) {
    k_params4(b, kBytes, scale, min);
  }
  static __m256i codes(const uint8_t* b, int s) {
    const __m256i low = shift_bytes(load32(b + 48 + 32 * (s / 2)), 4 * (s % 2), 0x0F);
    return with_fifth_bit(low, fifth_bits(b, s));
  }
  static __m512i words(const uint8_t* b, int s) {
    const __m512i low = shift_words(widen32(b + 48 + 32 * (s / 2)), 4 * (s % 2));
    return with_fifth_bit_words(low, fifth_bits(b, s));
  }
};

struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210, kGroup = 16, kCodeBits = 6;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* scale, float* min) {
    const __m512 sc = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192))));
    const __m512 s = _mm512_mul_ps(sc, _mm512_set1_ps(half(b + 208)));
    _mm512_storeu_ps(scale, s);
    _mm512_storeu_ps(min, _mm512_mul_ps(s, _mm512_set1_ps(-32.0f)));
  }
  static __m256i codes(const uint8_t* b, int s) {
    const int h = s / 4;
    const __m256i low = shift_bytes(load32(b + 64 * h + 32 * (s % 2)), 4 * ((s / 2) % 2), 0x0F);
    const __m256i high = shift_bytes(load32(b + 128 + 32 * h), 2 * (s % 4), 0x03);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
  // Bits 2 (s % 4) and up of the qh word, moved to bit 4 (after << 4, >> 2 (s % 4)).
  static __m512i words(const uint8_t* b, int s) {
    const int h = s / 4;
    const __m512i low = _mm512_and_si512(
        shift_words(widen32(b + 64 * h + 32 * (s % 2)), 4 * ((s / 2) % 2)),
        _mm512_set1_epi16(0x0F));
    const __m512i high =
        shift_words(_mm512_slli_epi16(widen32(b + 128 + 32 * h), 4), 2 * (s % 4));
    return _mm512_ternarylogic_epi32(high, _mm512_set1_epi16(0x30), low, 0xEA);  // (a & b) | c
  }
};

template <class F>
constexpr int kSubs = F::kWeights / 32;  // 32-weight sub-blocks per block

template <class F>
constexpr int kGroupsPerBlock = F::kWeights / F::kGroup;

// Formats whose params come 4 blocks at a time (F::params4).
template <class F>
constexpr bool kParams4 = std::is_same_v<F, Q4_K> || std::is_same_v<F, Q5_K>;

// fn(F{}) for the format of ggml type `kind`.
template <typename Fn>
auto dispatch(int kind, Fn&& fn) {
  switch (kind) {
    case kQ4_0: return fn(Q4_0{});
    case kQ4_1: return fn(Q4_1{});
    case kQ5_0: return fn(Q5_0{});
    case kQ5_1: return fn(Q5_1{});
    case kQ8_0: return fn(Q8_0{});
    case kQ4_K: return fn(Q4_K{});
    case kQ5_K: return fn(Q5_K{});
    case kQ6_K: return fn(Q6_K{});
  }
  throw std::invalid_argument("unsupported ggml block type");
}

inline bool supported(int kind) {
  switch (kind) {
    case kQ4_0: case kQ4_1: case kQ5_0: case kQ5_1: case kQ8_0: case kQ4_K: case kQ5_K:
    case kQ6_K:
      return true;
  }
  return false;
}

// One row's scales and mins, all groups in order: scale[g], min[g] for g < K / kGroup.
// 32-weight formats: the 4 bytes at each block's start (fp16 d, then m or codes) gathered 16
// blocks at a time (measured faster than 16 scalar loads into a vector: Q4_1, 1 row, 1.3-1.5x
// -> 1.05-1.3x the time of a kernel over the same weights repacked into separate codes and
// fp32 scales).
template <class F>
void read_params(const uint8_t* row, int64_t K, float* scale, float* min) {
  const int64_t blocks = K / F::kWeights;
  if constexpr (F::kWeights == 32) {
    const __m512i offsets = _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(F::kBytes));
    for (int64_t blk = 0; blk < blocks; blk += 16) {
      const int64_t n = blocks - blk;
      const __mmask16 lanes = n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
      const __m512i head = _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), lanes, offsets,
                                                       row + blk * F::kBytes, 1);
      const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(head));
      __m512 m = _mm512_mul_ps(d, _mm512_set1_ps(-static_cast<float>(F::kMinCodes)));
      if constexpr (F::kMinAt == 2)
        m = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
      _mm512_mask_storeu_ps(scale + blk, lanes, d);
      _mm512_mask_storeu_ps(min + blk, lanes, m);
    }
  } else {
    constexpr int kG = kGroupsPerBlock<F>;
    int64_t blk = 0;
    if constexpr (kParams4<F>)
      for (; blk + 4 <= blocks; blk += 4)
        F::params4(row + blk * F::kBytes, scale + blk * kG, min + blk * kG);
    for (; blk < blocks; ++blk) F::params(row + blk * F::kBytes, scale + blk * kG, min + blk * kG);
  }
}

template <class F>
inline __m256i sub_block_codes(const uint8_t* row, int64_t b) {
  return F::codes(row + (b / kSubs<F>) * F::kBytes, static_cast<int>(b % kSubs<F>));
}

// The codes of a sub-block as 16 + 16 exact floats (elements 0-15, 16-31).
template <class F>
inline void codes_f32(__m256i codes, __m512& lo, __m512& hi) {
  const __m128i a = _mm256_castsi256_si128(codes), b = _mm256_extracti128_si256(codes, 1);
  if constexpr (F::kSigned) {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b));
  } else {
    lo = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(a));
    hi = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(b));
  }
}

// Formats whose sub-block has one scale and min and codes of at most 5 bits: bf16_weights
// computes the sub-block's 2^bits possible weights once and looks each weight up (vpermw)
// instead of converting all 32 codes to fp32 and back (measured 1.2-1.3x faster on
// gguf_tiles.cpp's kernel); the same fma and the same rounding, so the same bits.
template <class F>
constexpr bool kLookup = F::kGroup == 32 && !F::kSigned && F::kCodeBits <= 5;

// The weights of codes first .. first + 15 under one scale and min: scale * code + min.
inline __m512 code_weights(float scale, float min, float first) {
  const __m512 codes = _mm512_add_ps(
      _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15), _mm512_set1_ps(first));
  return _mm512_fmadd_ps(_mm512_set1_ps(scale), codes, _mm512_set1_ps(min));
}

template <class F>
inline __m512bh looked_up_weights(const uint8_t* row, int64_t b, const float* scale,
                                  const float* min) {
  const __m512 lo = code_weights(scale[b], min[b], 0);
  const __m512 hi = F::kCodeBits > 4 ? code_weights(scale[b], min[b], 16) : lo;
  const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // words: weight of code i
  const __m512i codes = _mm512_and_si512(
      F::words(row + (b / kSubs<F>) * F::kBytes, static_cast<int>(b % kSubs<F>)),
      _mm512_set1_epi16((1 << F::kCodeBits) - 1));
  return (__m512bh)_mm512_permutexvar_epi16(codes, table);
}

// Sub-block b's weights exactly (as gguf-py's float32), then rounded to bf16 (nearest even).
template <class F>
inline __m512bh bf16_weights(const uint8_t* row, int64_t b, const float* scale,
                             const float* min) {
  if constexpr (kLookup<F>) return looked_up_weights<F>(row, b, scale, min);
  __m512 lo, hi;
  codes_f32<F>(sub_block_codes<F>(row, b), lo, hi);
  const int64_t g_lo = b * 32 / F::kGroup, g_hi = (b * 32 + 16) / F::kGroup;
  lo = _mm512_fmadd_ps(_mm512_set1_ps(scale[g_lo]), lo, _mm512_set1_ps(min[g_lo]));
  hi = _mm512_fmadd_ps(_mm512_set1_ps(scale[g_hi]), hi, _mm512_set1_ps(min[g_hi]));
  return _mm512_cvtne2ps_pbh(hi, lo);
}

// Formats whose sub-blocks 2j and 2j + 1 are the low and high nibbles of the same 32 bytes
// (Q4_K): bf16_weight_pair decodes both from one load and one table.
template <class F>
constexpr bool kNibblePairs = std::is_same_v<F, Q4_K>;

// Sub-blocks b and b + 1 (b even) as bf16_weights gives them. Nibble pairs: one 32-word table,
// entries 0-15 sub-block b's weights for codes 0-15 and 16-31 sub-block b + 1's, indexed by
// the low nibbles and by the high nibbles + 16 of one widened load: one table conversion and
// one load where two calls take two of each (gguf_tiles.cpp's kernel, 32 rows, 1.5B-shaped
// Q4_K from memory: 1.07-1.08x).
template <class F>
inline void bf16_weight_pair(const uint8_t* row, int64_t b, const float* scale,
                             const float* min, __m512bh& even, __m512bh& odd) {
  if constexpr (kNibblePairs<F>) {
    const __m512 lo = code_weights(scale[b], min[b], 0);
    const __m512 hi = code_weights(scale[b + 1], min[b + 1], 0);
    const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);
    const __m512i words =
        F::pair_bytes(row + (b / kSubs<F>) * F::kBytes, static_cast<int>(b % kSubs<F>));
    const __m512i low = _mm512_and_si512(words, _mm512_set1_epi16(0x0F));
    const __m512i high = _mm512_or_si512(_mm512_srli_epi16(words, 4), _mm512_set1_epi16(0x10));
    even = (__m512bh)_mm512_permutexvar_epi16(low, table);
    odd = (__m512bh)_mm512_permutexvar_epi16(high, table);
  } else {
    even = bf16_weights<F>(row, b, scale, min);
    odd = bf16_weights<F>(row, b + 1, scale, min);
  }
}

}  // namespace gguf
}  // namespace meterserve
