// GGUF matrix-vector products with int8 inputs for 1-8 rows on AVX2: EngineConfig.gguf_activations
// "int8" on CPUs without AVX-512, the same rounding as the AVX-512 kernel (csrc/gguf_int8.cpp)
// and engine/gguf_blocks.py's int8_inputs, its reference.
//
// Without AVX-512 the exact path (gguf_f32.cpp) widens every 8 codes to fp32 and spends a
// scale multiply-add and a product multiply-add on each weight. With the inputs rounded to
// int8 (as llama.cpp does on every CPU), 32 codes times 32 inputs are one vpmaddubsw (u8 x s8
// into 16-bit pairs, exact: at most 2 x 63 x 127) and one vpmaddwd by the sub-block's integer
// scale (or by ones) into int32 lanes; the fp32 work is one multiply-add per 32 weights (the
// 32-weight formats) or per 256 (the K-quants).
//
// Inputs: each block of the format's weights (256 for the K-quants, 32 for the others) of a
// row as dx * xq, dx = max |x| / 127, xq = round(x * (127 / max |x|)) (nearest even). Per row:
//   Q4_K, Q5_K:  per super-block dx (d sum_s sc[s] (q_s . xq_s) - dmin sum_s m[s] sum(xq_s))
//   Q6_K:        per super-block dx d sum_g sc[g] (q_g . xq_g - 32 sum(xq_g))   g: 16 inputs
//   others:      per block dx (d (q . xq) + m sum(xq))   m: the stored min, -8 d or -16 d;
//                Q8_0's signed codes by their magnitude times the inputs carrying their sign
// The integer sums are exact; the result differs from the exact weights' product by the
// inputs' rounding and fp32 summation order only.
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "avx2_kernels.h"
#include "gguf_formats.h"

namespace avx2 {
namespace {

// The rows' inputs rounded to int8 per group of `group` (the format's block).
struct Int8Inputs {
  int64_t K, groups;          // groups = K / group
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, groups]: dx
  std::vector<int16_t> sums;  // [M, K / 16]: the sum of each 16 consecutive q (|sum| <= 2032)
  std::vector<int16_t> sums32;  // [M, K / 32]: the sum of each 32
  std::vector<float> scaled_sums32;  // [M, K / 32]: dx sum(q) of each 32 (32-weight formats)
};

Int8Inputs quantize(const float* x, int64_t M, int64_t K, int64_t group) {
  Int8Inputs in{K, K / group, std::vector<int8_t>(M * K), std::vector<float>(M * (K / group)),
                std::vector<int16_t>(M * (K / 16)), std::vector<int16_t>(M * (K / 32)),
                std::vector<float>(group == 32 ? M * (K / 32) : 0)};
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t g = 0; g < K / group; ++g) {
      const float* xs = x + m * K + g * group;
      float max = 0.0f;
      for (int64_t k = 0; k < group; ++k) max = std::max(max, std::fabs(xs[k]));
      // 127 / max once, then a product per input: int8_inputs rounds the same two times.
      const float inverse = max > 0.0f ? 127.0f / max : 0.0f;
      in.scale[m * in.groups + g] = max / 127.0f;
      int8_t* q = in.q.data() + m * K + g * group;
      for (int64_t k = 0; k < group; ++k)
        q[k] = static_cast<int8_t>(std::nearbyint(xs[k] * inverse));
    }
    for (int64_t j = 0; j < K / 16; ++j) {
      int sum = 0;
      for (int k = 0; k < 16; ++k) sum += in.q[m * K + 16 * j + k];
      in.sums[m * (K / 16) + j] = static_cast<int16_t>(sum);
    }
    for (int64_t j = 0; j < K / 32; ++j)
      in.sums32[m * (K / 32) + j] = static_cast<int16_t>(in.sums[m * (K / 16) + 2 * j] +
                                                         in.sums[m * (K / 16) + 2 * j + 1]);
    if (group == 32)
      for (int64_t j = 0; j < K / 32; ++j)
        in.scaled_sums32[m * (K / 32) + j] =
            in.scale[m * in.groups + j] * static_cast<float>(in.sums32[m * (K / 32) + j]);
  }
  return in;
}

// 16 sums of adjacent pairs of codes[i] * xq[i], int16, exact.
template <class F>
inline __m256i pair_products(__m256i codes, const int8_t* xq) {
  const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq));
  if constexpr (F::kSigned)  // |code| (u8, up to 128) times the input with the code's sign
    return _mm256_maddubs_epi16(_mm256_sign_epi8(codes, codes), _mm256_sign_epi8(x, codes));
  return _mm256_maddubs_epi16(codes, x);
}

template <class F>
constexpr bool kSuperBlock = F::kWeights == 256;

// Q4_0, Q4_1, Q5_0, Q5_1, Q8_0: one block of 32 weights, one scale and one min.
template <class F, int M>
inline void block32(const uint8_t* block, int64_t b, const Int8Inputs& in, __m256 acc[M],
                    __m128 offset[M]) {
  float d, min;
  F::params(block, &d, &min);
  const __m256i codes = F::codes(block, 0);
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < M; ++m) {
    const int8_t* xq = in.q.data() + m * in.K + 32 * b;
    const float dx = in.scale[m * in.groups + b];
    const __m256i sums = _mm256_madd_epi16(pair_products<F>(codes, xq), ones);
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums), acc[m]);
    const float scaled_sum = in.scaled_sums32[m * (in.K / 32) + b];
    offset[m] = _mm_fmadd_ss(_mm_set_ss(min), _mm_set_ss(scaled_sum), offset[m]);
  }
}

// Q4_K, Q5_K: 8 6-bit scales in bytes 0-7 of the result, 8 6-bit mins in bytes 8-15 (the
// same unpacking as gguf_formats.h's k_ints, four at a time in 32-bit words).
inline __m128i k_scales_and_mins(const uint8_t* block) {
  constexpr uint32_t kLow6 = 0x3f3f3f3f, kLow4 = 0x0f0f0f0f, kLow2 = 0x03030303;
  uint32_t w[3];
  std::memcpy(w, block + 4, sizeof(w));
  const uint32_t scales_high = (w[2] & kLow4) | (((w[0] >> 6) & kLow2) << 4);
  const uint32_t mins_high = ((w[2] >> 4) & kLow4) | (((w[1] >> 6) & kLow2) << 4);
  return _mm_setr_epi32(static_cast<int>(w[0] & kLow6), static_cast<int>(scales_high),
                        static_cast<int>(w[1] & kLow6), static_cast<int>(mins_high));
}

// int16 lane s of each 128-bit half repeated across its 8 lanes (the scale of sub-block s).
inline __m256i repeat_lane(__m256i lanes, int s) {
  const __m256i pick = _mm256_set1_epi16(static_cast<int16_t>((2 * s) | ((2 * s + 1) << 8)));
  return _mm256_shuffle_epi8(lanes, pick);
}

// A super-block's 8 sub-blocks of codes times the 256 inputs xq, each sub-block's pair sums
// multiplied by its 16-bit scales (sub_scales[s]) into 8 int32 lanes, exactly.
template <class F>
inline __m256i scaled_sums(const __m256i codes[8], const __m256i sub_scales[8], const int8_t* xq) {
  __m256i sums = _mm256_setzero_si256();
  for (int s = 0; s < 8; ++s)
    sums = _mm256_add_epi32(
        sums, _mm256_madd_epi16(pair_products<F>(codes[s], xq + 32 * s), sub_scales[s]));
  return sums;
}

// Q4_K, Q5_K: a super-block of 8 sub-blocks of 32, 6-bit scales and mins.
template <class F, int M>
inline void k_super_block(const uint8_t* block, int64_t sb, const Int8Inputs& in, __m256 acc[M],
                          __m128 offset[M]) {
  const __m128i packed = k_scales_and_mins(block);
  const __m256i scales = _mm256_broadcastsi128_si256(_mm_cvtepu8_epi16(packed));
  const __m128i mins = _mm_cvtepu8_epi16(_mm_srli_si128(packed, 8));
  const float d = half(block), dmin = half(block + 2);
  __m256i codes[8], sub_scales[8];
  for (int s = 0; s < 8; ++s) {
    codes[s] = F::codes(block, s);
    sub_scales[s] = repeat_lane(scales, s);
  }
  for (int m = 0; m < M; ++m) {
    const __m256i sums = scaled_sums<F>(codes, sub_scales, in.q.data() + m * in.K + 256 * sb);
    const __m128i input_sums = _mm_loadu_si128(
        reinterpret_cast<const __m128i*>(in.sums32.data() + m * (in.K / 32) + 8 * sb));
    const float dx = in.scale[m * in.groups + sb];
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(d * dx), _mm256_cvtepi32_ps(sums), acc[m]);
    offset[m] = _mm_fmadd_ps(_mm_set1_ps(-dmin * dx),
                             _mm_cvtepi32_ps(_mm_madd_epi16(mins, input_sums)), offset[m]);
  }
}

// Q6_K: a super-block of 16 groups of 16, signed 8-bit scales, codes 0-63 offset by -32.
template <class F, int M>
inline void q6_k_super_block(const uint8_t* block, int64_t sb, const Int8Inputs& in,
                             __m256 acc[M], __m128 offset[M]) {
  const float d = half(block + 208);
  const __m128i scale_bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + 192));
  const __m256i group_scales = _mm256_cvtepi8_epi16(scale_bytes);  // 16 groups' scales
  __m256i codes[8], sub_scales[8];
  for (int s = 0; s < 8; ++s) {
    codes[s] = F::codes(block, s);
    // 16-bit lanes 0-7 hold elements 0-15 of the sub-block (group 2 s), lanes 8-15 the rest.
    const __m128i pick = _mm_setr_epi8(2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s, 2 * s,
                                       2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1, 2 * s + 1,
                                       2 * s + 1, 2 * s + 1, 2 * s + 1);
    sub_scales[s] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(scale_bytes, pick));
  }
  for (int m = 0; m < M; ++m) {
    const __m256i sums = scaled_sums<F>(codes, sub_scales, in.q.data() + m * in.K + 256 * sb);
    const __m256i input_sums = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(in.sums.data() + m * (in.K / 16) + 16 * sb));
    const __m256i shift = _mm256_madd_epi16(group_scales, input_sums);  // sum_g sc[g] sum(xq_g)
    const float ddx = d * in.scale[m * in.groups + sb];
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(ddx), _mm256_cvtepi32_ps(sums), acc[m]);
    acc[m] = _mm256_fmadd_ps(_mm256_set1_ps(-32.0f * ddx), _mm256_cvtepi32_ps(shift), acc[m]);
  }
  (void)offset;
}

template <class F, int M>
void int8_rows(const Int8Inputs& in, const uint8_t* blocks, int64_t N, const float* bias,
               float* out) {
  const int64_t num_blocks = in.K / F::kWeights, row_bytes = num_blocks * F::kBytes;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    __m256 acc[M];
    __m128 offset[M];  // the mins' part: lanes summed at the end
    for (int m = 0; m < M; ++m) acc[m] = _mm256_setzero_ps(), offset[m] = _mm_setzero_ps();
    const uint8_t* row = blocks + n * row_bytes;
    for (int64_t b = 0; b < num_blocks; ++b) {
      const uint8_t* block = row + b * F::kBytes;
      if constexpr (std::is_same_v<F, Q6_K>) q6_k_super_block<F, M>(block, b, in, acc, offset);
      else if constexpr (kSuperBlock<F>) k_super_block<F, M>(block, b, in, acc, offset);
      else block32<F, M>(block, b, in, acc, offset);
    }
    for (int m = 0; m < M; ++m)
      out[m * N + n] = hsum(_mm256_add_ps(acc[m], _mm256_set_m128(_mm_setzero_ps(), offset[m]))) +
                       (bias ? bias[n] : 0.0f);
  }
}

}  // namespace

torch::Tensor gguf_matvec_int8(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                               int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
                  x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "gguf_matvec_int8: x must be contiguous float32 [1..", kMaxRows, ", K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, N, row_bytes(kind, K));
  const float* bias_ptr = checked_bias(bias, N);
  auto out = torch::empty({M, N}, torch::kFloat32);
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  dispatch(static_cast<int>(kind), [&](auto format) {
    using F = decltype(format);
    const Int8Inputs in = quantize(x.data_ptr<float>(), M, K, F::kWeights);
    with_rows(M, [&](auto rows) { int8_rows<F, decltype(rows)::value>(in, w, N, bias_ptr, o); });
  });
  return out;
}

}  // namespace avx2
