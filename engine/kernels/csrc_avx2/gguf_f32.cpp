// GGUF blocks as stored, for CPUs with AVX2 + FMA + F16C and no AVX-512 (AMD Zen 2/3, older
// Xeons, desktop chips): the float32 serving path reads the file's blocks, never a float copy.
//
//   gguf_dequantize_f32: w [N, K] float32 from the blocks, equal to gguf-py bit for bit
//                        (engine/gguf_blocks.py's reference): w = fma(scale, q, min).
//   gguf_matvec_f32:     out[m, n] = sum_k x[m, k] w[n, k] (+ bias[n]) for 1-8 rows of float32
//                        x: each weight row's blocks are read once, dequantized in registers
//                        to those same exact weights, and multiplied into every row (fp32
//                        sums, 8 lanes, then a horizontal sum); threads split the weight rows.
//   gguf_panel_f32:      the same product for any M, over weight panels dequantized once per
//                        call (below).
// GGUFLinear picks by row count; the largest passes dequantize per call into torch's matmul.
//
// The block layouts are ggml's (engine/gguf_blocks.py's table); the AVX-512 kernels' decoders
// (csrc/gguf_blocks.h) read the same bytes with AVX-512 masks, which this file cannot use.
#include <immintrin.h>
#include <torch/extension.h>

#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>

namespace {

enum Kind : int { kQ4_0 = 2, kQ4_1 = 3, kQ5_0 = 6, kQ5_1 = 7, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

float half(const uint8_t* p) {
  uint16_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return _cvtsh_ss(bits);
}

uint32_t u32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

__m256i load32(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// 16 bytes of nibbles -> 32 codes, elements 0-15 the low nibbles, 16-31 the high ones.
__m256i nibbles(const uint8_t* qs) {
  const __m256i both =
      _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  return _mm256_and_si256(_mm256_blend_epi32(both, _mm256_srli_epi16(both, 4), 0xF0),
                          _mm256_set1_epi8(0x0F));
}

// Per byte: (v >> count) & keep, count < 8 (a 16-bit shift; the mask drops what crossed).
__m256i shift_bytes(__m256i v, int count, int keep) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(count)), _mm256_set1_epi8(keep));
}

// 0x10 in byte j where bit j of `bits` is set (Q5_0 / Q5_1's fifth bits): byte j takes byte
// j / 8 of bits, then tests bit j % 8.
__m256i fifth_bit_bytes(uint32_t bits) {
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
void k_params(const uint8_t* b, float* scale, float* min) {
  const uint8_t* q = b + 4;
  const float d = half(b), dmin = half(b + 2);
  for (int j = 0; j < 8; ++j) {
    const int sc = j < 4 ? q[j] & 63 : (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
    const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    scale[j] = d * static_cast<float>(sc);
    min[j] = -(dmin * static_cast<float>(m));
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
  TORCH_CHECK(false, "gguf (AVX2): unsupported ggml block type ", kind);
}

// Sub-block s of `block`, its weights exactly: w[v] holds elements 8 v .. 8 v + 7.
template <class F>
inline void sub_block_weights(const uint8_t* block, int s, const float* scale, const float* min,
                              __m256 w[4]) {
  const __m256i codes = F::codes(block, s);
  const __m128i halves[2] = {_mm256_castsi256_si128(codes), _mm256_extracti128_si256(codes, 1)};
#pragma GCC unroll 4
  for (int v = 0; v < 4; ++v) {
    const __m128i bytes = v % 2 ? _mm_srli_si128(halves[v / 2], 8) : halves[v / 2];
    const __m256i ints = F::kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
    const int g = (32 * s + 8 * v) / F::kGroup;
    w[v] = _mm256_fmadd_ps(_mm256_set1_ps(scale[g]), _mm256_cvtepi32_ps(ints),
                           _mm256_set1_ps(min[g]));
  }
}

// The row's blocks in order: fn(s_global, w[4]) for each 32-weight sub-block.
template <class F, typename Fn>
inline void for_each_sub_block(const uint8_t* row, int64_t K, Fn&& fn) {
  constexpr int kGroups = F::kWeights / F::kGroup, kSubs = F::kWeights / 32;
  float scale[kGroups], min[kGroups];
  __m256 w[4];
  for (int64_t blk = 0; blk < K / F::kWeights; ++blk) {
    const uint8_t* block = row + blk * F::kBytes;
    F::params(block, scale, min);
#pragma GCC unroll 8
    for (int s = 0; s < kSubs; ++s) {
      sub_block_weights<F>(block, s, scale, min, w);
      fn(blk * kSubs + s, w);
    }
  }
}

float hsum(__m256 v) {
  const __m128 four = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 two = _mm_add_ps(four, _mm_movehl_ps(four, four));
  return _mm_cvtss_f32(_mm_add_ss(two, _mm_movehdup_ps(two)));
}

// Independent fma chains per row (one chain stalls on fma latency); AVX2 has 16 registers.
template <int M>
constexpr int kChains = M <= 2 ? 4 : M <= 4 ? 2 : 1;

template <class F, int M>
void matvec_rows(const float* x, const uint8_t* blocks, int64_t N, int64_t K, const float* bias,
                 float* out) {
  constexpr int kC = kChains<M>;
  const int64_t row_bytes = K / F::kWeights * F::kBytes;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    __m256 acc[M][kC];
    for (int m = 0; m < M; ++m)
      for (int c = 0; c < kC; ++c) acc[m][c] = _mm256_setzero_ps();
    for_each_sub_block<F>(blocks + n * row_bytes, K, [&](int64_t b, const __m256 w[4]) {
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) {
        const float* xs = x + m * K + b * 32;
#pragma GCC unroll 4
        for (int v = 0; v < 4; ++v)
          acc[m][v % kC] = _mm256_fmadd_ps(w[v], _mm256_loadu_ps(xs + 8 * v), acc[m][v % kC]);
      }
    });
    for (int m = 0; m < M; ++m) {
      __m256 total = acc[m][0];
      for (int c = 1; c < kC; ++c) total = _mm256_add_ps(total, acc[m][c]);
      out[m * N + n] = hsum(total) + (bias ? bias[n] : 0.0f);
    }
  }
}

constexpr int64_t kMaxRows = 8;

// Any M: threads take panels of kPanel weight rows, dequantize each panel once into a
// thread-local buffer [kPanel, K] (the exact weights; K <= ~2,000 keeps it in L1/L2), then
// multiply it into every input row, kXRows rows at a time (a kPanel x kXRows block of fma
// chains: 12 accumulators + 4 + 3 loads per step fit AVX2's 16 registers).
constexpr int kPanel = 4, kXRows = 3;

template <int R>
inline void panel_dot(const float* panel, const float* x, int64_t K, int64_t M, int64_t m,
                      float out[kPanel][kXRows]) {
  __m256 acc[kPanel][R];
  for (int i = 0; i < kPanel; ++i)
    for (int j = 0; j < R; ++j) acc[i][j] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 xs[R];
#pragma GCC unroll 3
    for (int j = 0; j < R; ++j) xs[j] = _mm256_loadu_ps(x + (m + j) * K + k);
#pragma GCC unroll 4
    for (int i = 0; i < kPanel; ++i) {
      const __m256 w = _mm256_loadu_ps(panel + i * K + k);
#pragma GCC unroll 3
      for (int j = 0; j < R; ++j) acc[i][j] = _mm256_fmadd_ps(w, xs[j], acc[i][j]);
    }
  }
  for (int i = 0; i < kPanel; ++i)
    for (int j = 0; j < R; ++j) out[i][j] = hsum(acc[i][j]);
  (void)M;
}

template <class F>
void panel_rows(const float* x, const uint8_t* blocks, int64_t N, int64_t K, int64_t M,
                const float* bias, float* out) {
  const int64_t row_bytes = K / F::kWeights * F::kBytes;
  const int64_t panels = (N + kPanel - 1) / kPanel;
#pragma omp parallel
  {
    std::vector<float> panel(kPanel * K, 0.0f);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int64_t n0 = p * kPanel, rows = std::min<int64_t>(kPanel, N - n0);
      for (int64_t i = 0; i < rows; ++i) {
        float* w_row = panel.data() + i * K;
        for_each_sub_block<F>(blocks + (n0 + i) * row_bytes, K, [&](int64_t b, const __m256 w[4]) {
          for (int v = 0; v < 4; ++v) _mm256_storeu_ps(w_row + b * 32 + 8 * v, w[v]);
        });
      }
      float sums[kPanel][kXRows];
      for (int64_t m = 0; m < M; m += kXRows) {
        const int64_t r = std::min<int64_t>(kXRows, M - m);
        if (r == 3) panel_dot<3>(panel.data(), x, K, M, m, sums);
        else if (r == 2) panel_dot<2>(panel.data(), x, K, M, m, sums);
        else panel_dot<1>(panel.data(), x, K, M, m, sums);
        for (int64_t i = 0; i < rows; ++i)
          for (int64_t j = 0; j < r; ++j)
            out[(m + j) * N + n0 + i] = sums[i][j] + (bias ? bias[n0 + i] : 0.0f);
      }
    }
  }
}

int64_t row_bytes(int64_t kind, int64_t K) {
  return dispatch(static_cast<int>(kind), [&](auto format) -> int64_t {
    using F = decltype(format);
    TORCH_CHECK(K > 0 && K % F::kWeights == 0, "gguf (AVX2): K = ", K,
                " is not a whole number of blocks of ", F::kWeights);
    return K / F::kWeights * F::kBytes;
  });
}

void check_blocks(const torch::Tensor& blocks, int64_t N, int64_t bytes) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == torch::kUInt8 &&
                  blocks.is_contiguous() && blocks.numel() == N * bytes,
              "gguf (AVX2): blocks must be contiguous uint8 holding ", N, " x ", bytes, " bytes");
}

const float* checked_bias(const c10::optional<torch::Tensor>& bias, int64_t N) {
  if (!bias.has_value()) return nullptr;
  TORCH_CHECK(bias->scalar_type() == torch::kFloat32 && bias->is_contiguous() &&
                  bias->numel() == N,
              "gguf (AVX2): bias must be contiguous float32 [N]");
  return bias->data_ptr<float>();
}

torch::Tensor gguf_dequantize_f32(const torch::Tensor& blocks, int64_t kind, int64_t N,
                                  int64_t K) {
  check_blocks(blocks, N, row_bytes(kind, K));
  auto out = torch::empty({N, K}, torch::kFloat32);
  const uint8_t* src = blocks.data_ptr<uint8_t>();
  float* dst = out.data_ptr<float>();
  dispatch(static_cast<int>(kind), [&](auto format) {
    using F = decltype(format);
    const int64_t bytes = K / F::kWeights * F::kBytes;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; ++n) {
      float* w_row = dst + n * K;
      for_each_sub_block<F>(src + n * bytes, K, [&](int64_t b, const __m256 w[4]) {
        for (int v = 0; v < 4; ++v) _mm256_storeu_ps(w_row + b * 32 + 8 * v, w[v]);
      });
    }
  });
  return out;
}

torch::Tensor gguf_panel_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                             int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.scalar_type() == torch::kFloat32 &&
                  x.is_contiguous(),
              "gguf_panel_f32: x must be contiguous float32 [M, K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, N, row_bytes(kind, K));
  const float* bias_ptr = checked_bias(bias, N);
  auto out = torch::empty({M, N}, torch::kFloat32);
  dispatch(static_cast<int>(kind), [&](auto format) {
    panel_rows<decltype(format)>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), N, K, M,
                                 bias_ptr, out.data_ptr<float>());
  });
  return out;
}

torch::Tensor gguf_matvec_f32(const torch::Tensor& x, const torch::Tensor& blocks, int64_t kind,
                              int64_t N, const c10::optional<torch::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) >= 1 && x.size(0) <= kMaxRows &&
                  x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "gguf_matvec_f32: x must be contiguous float32 [1..", kMaxRows, ", K]");
  const int64_t M = x.size(0), K = x.size(1);
  check_blocks(blocks, N, row_bytes(kind, K));
  const float* bias_ptr = checked_bias(bias, N);
  auto out = torch::empty({M, N}, torch::kFloat32);
  const float* xs = x.data_ptr<float>();
  const uint8_t* w = blocks.data_ptr<uint8_t>();
  float* o = out.data_ptr<float>();
  dispatch(static_cast<int>(kind), [&](auto format) {
    using F = decltype(format);
    switch (M) {
      case 1: return matvec_rows<F, 1>(xs, w, N, K, bias_ptr, o);
      case 2: return matvec_rows<F, 2>(xs, w, N, K, bias_ptr, o);
      case 3: return matvec_rows<F, 3>(xs, w, N, K, bias_ptr, o);
      case 4: return matvec_rows<F, 4>(xs, w, N, K, bias_ptr, o);
      case 5: return matvec_rows<F, 5>(xs, w, N, K, bias_ptr, o);
      case 6: return matvec_rows<F, 6>(xs, w, N, K, bias_ptr, o);
      case 7: return matvec_rows<F, 7>(xs, w, N, K, bias_ptr, o);
      default: return matvec_rows<F, 8>(xs, w, N, K, bias_ptr, o);
    }
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("gguf_matvec_f32", &gguf_matvec_f32,
        "x[M <= 8, K] float32 @ w.T (+ bias), w = ggml blocks as stored (exact weights)",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_panel_f32", &gguf_panel_f32,
        "x[M, K] float32 @ w.T (+ bias) for any M: weight panels dequantized once per call",
        py::arg("x"), py::arg("blocks"), py::arg("kind"), py::arg("out_features"),
        py::arg("bias") = py::none(), py::call_guard<py::gil_scoped_release>());
  m.def("gguf_dequantize_f32", &gguf_dequantize_f32,
        "float32 [N, K] from ggml blocks, equal to gguf-py's dequantize", py::arg("blocks"),
        py::arg("kind"), py::arg("rows"), py::arg("cols"),
        py::call_guard<py::gil_scoped_release>());
  m.attr("max_rows") = kMaxRows;
}
