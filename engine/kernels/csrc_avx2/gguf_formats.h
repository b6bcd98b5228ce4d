// The ggml block formats as the AVX2 kernels read them (gguf_f32.cpp: exact float32 weights;
// gguf_int8.cpp: the stored codes times int8 inputs). The layouts are ggml's (engine/
// gguf_blocks.py's table); the AVX-512 kernels' decoders (csrc/gguf_blocks.h) read the same bytes
// with AVX-512 masks, which these files cannot use.
#pragma once

#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <type_traits>

namespace avx2 {

enum Kind : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

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

inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}

// 16 bytes of nibbles -> 32 codes, elements 0-15 the low nibbles, 16-31 the high ones.
inline __m256i nibbles(const uint8_t* qs) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0),
                          _mm256_set1_epi8(0x0F));
}

// Per byte: (v >> count) & keep, count < 8 (a 16-bit shift; the mask drops what crossed).
inline __m256i shift_bytes(__m256i v, int count, int keep) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(count)), _mm256_set1_epi8(keep));
}

// 0x10 in byte j where bit j of `bits` is set (Q5_0 / Q5_1's fifth bits): byte j takes byte
// j / 8 of bits, then tests bit j % 8.
inline __m256i fifth_bit_bytes(uint32_t bits) {
  const __m256i spread = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int>(bits)),
      _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3,
                       3, 3, 3, 3, 3, 3, 3));
  const __m256i bit = _mm256_set1_epi64x(0x8040201008040201LL);
  const __m256i set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, bit), bit);
  return _mm256_and_si256(set, _mm256_set1_epi8(0x10));
}

// Each format: kWeights and kBytes per block, kGroup weights per scale, kSigned codes,
// params(block, scale, min) for the block's kWeights / kGroup groups (w = scale q + min, the
// products exact as in gguf-py) and codes(block, s): sub-block s's 32 codes in element order.
struct Q4_0 {
  static constexpr int kWeights = 32, kBytes = 18, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { s[0] = half(b), m[0] = -8 * s[0]; }
  static __m256i codes(const uint8_t* b, int) { return nibbles(b + 2); }
};
struct Q4_1 {
  static constexpr int kWeights = 32, kBytes = 20, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { s[0] = half(b), m[0] = half(b + 2); }
  static __m256i codes(const uint8_t* b, int) { return nibbles(b + 4); }
};
struct Q5_0 {
  static constexpr int kWeights = 32, kBytes = 22, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { s[0] = half(b), m[0] = -16 * s[0]; }
  static __m256i codes(const uint8_t* b, int) {
    return _mm256_or_si256(nibbles(b + 6), fifth_bit_bytes(u32(b + 2)));
  }
};
struct Q5_1 {
  static constexpr int kWeights = 32, kBytes = 24, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { s[0] = half(b), m[0] = half(b + 2); }
  static __m256i codes(const uint8_t* b, int) {
    return _mm256_or_si256(nibbles(b + 8), fifth_bit_bytes(u32(b + 4)));
  }
};
struct Q8_0 {
  static constexpr int kWeights = 32, kBytes = 34, kGroup = 32;
  static constexpr bool kSigned = true;
  static void params(const uint8_t* b, float* s, float* m) { s[0] = half(b), m[0] = 0.0f; }
  static __m256i codes(const uint8_t* b, int) { return load32(b + 2); }
};

// Q4_K / Q5_K: 8 6-bit scales and mins packed in bytes 4-15 (gguf_blocks.py's _k_scales).
inline void k_ints(const uint8_t* b, int* scale, int* min) {
  const uint8_t* q = b + 4;
  for (int j = 0; j < 8; ++j) {
    scale[j] = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    min[j] = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}
inline void k_params(const uint8_t* b, float* scale, float* min) {
  int sc[8], m[8];
  k_ints(b, sc, m);
  const float d = half(b), dmin = half(b + 2);
  for (int j = 0; j < 8; ++j) {
    scale[j] = d * static_cast<float>(sc[j]);
    min[j] = -(dmin * static_cast<float>(m[j]));
  }
}
struct Q4_K {
  static constexpr int kWeights = 256, kBytes = 144, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { k_params(b, s, m); }
  static __m256i codes(const uint8_t* b, int s) {
    return shift_bytes(load32(b + 16 + 32 * (s / 2)), 4 * (s % 2), 0x0F);
  }
};
struct Q5_K {
  static constexpr int kWeights = 256, kBytes = 176, kGroup = 32;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* s, float* m) { k_params(b, s, m); }
  static __m256i codes(const uint8_t* b, int s) {
    const __m256i low = shift_bytes(load32(b + 48 + 32 * (s / 2)), 4 * (s % 2), 0x0F);
    const __m256i fifth = _mm256_slli_epi16(shift_bytes(load32(b + 16), s, 1), 4);  // 0 or 16
    return _mm256_or_si256(low, fifth);
  }
};
struct Q6_K {
  static constexpr int kWeights = 256, kBytes = 210, kGroup = 16;
  static constexpr bool kSigned = false;
  static void params(const uint8_t* b, float* scale, float* min) {
    const float d = half(b + 208);
    for (int g = 0; g < 16; ++g) {
      scale[g] = d * static_cast<float>(static_cast<int8_t>(b[192 + g]));
      min[g] = scale[g] * -32.0f;
    }
  }
  static __m256i codes(const uint8_t* b, int s) {
    const int h = s / 4;
    const __m256i low = shift_bytes(load32(b + 64 * h + 32 * (s % 2)), 4 * ((s / 2) % 2), 0x0F);
    const __m256i high = shift_bytes(load32(b + 128 + 32 * h), 2 * (s % 4), 0x03);
    return _mm256_or_si256(low, _mm256_slli_epi16(high, 4));
  }
};

template <typename Fn>
inline auto dispatch(int kind, Fn&& fn) {
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
  TORCH_CHECK(false, "gguf (AVX2): unsupported ggml block type ", kind);
}

// fn(std::integral_constant<int, rows>()) for rows 1-8 (the matvecs' row counts; more: 8).
template <typename Fn>
inline void with_rows(int64_t rows, Fn&& fn) {
  switch (rows) {
    case 1: return fn(std::integral_constant<int, 1>());
    case 2: return fn(std::integral_constant<int, 2>());
    case 3: return fn(std::integral_constant<int, 3>());
    case 4: return fn(std::integral_constant<int, 4>());
    case 5: return fn(std::integral_constant<int, 5>());
    case 6: return fn(std::integral_constant<int, 6>());
    case 7: return fn(std::integral_constant<int, 7>());
    default: return fn(std::integral_constant<int, 8>());
  }
}

// The sum of v's 8 lanes.
inline float hsum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

int64_t row_bytes(int64_t kind, int64_t K);
void check_blocks(const torch::Tensor& blocks, int64_t N, int64_t bytes);
const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N);

}  // namespace avx2
