// Row-wise kernels that each replace a chain of small torch ops in a decoder layer.
//
// At decode batch sizes every torch op costs more in dispatch and allocation than in
// arithmetic; one pass per row here does the work of 4-8 ops. For bfloat16 the result is
// rounded wherever the torch chain (Hugging Face's Llama code) rounds, so bits match.
#include <cmath>
#include <cstring>

#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

// Forking threads costs microseconds; only batches with this many rows are split.
constexpr int64_t kParallelRows = 16;

// out = weight * round(x / rms(x)), rms in fp32 (HF: normalize in fp32, cast, scale).
template <typename T>
void normalize_row(const T* x, const T* weight, T* out, int64_t hidden, float eps) {
  __m512 sum_squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < hidden; i += kVecLanes) {
    const __m512 v = load(x + i, hidden - i);
    sum_squares = _mm512_fmadd_ps(v, v, sum_squares);
  }
  const float mean_square = _mm512_reduce_add_ps(sum_squares) / hidden;
  const __m512 inv_rms = _mm512_set1_ps(1.0f / std::sqrt(mean_square + eps));
  for (int64_t i = 0; i < hidden; i += kVecLanes) {
    const __m512 normed = round<T>(_mm512_mul_ps(load(x + i, hidden - i), inv_rms));
    store(out + i, _mm512_mul_ps(load(weight + i, hidden - i), normed), hidden - i);
  }
}

}  // namespace

template <typename T>
void rms_norm(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r)
    normalize_row(x + r * hidden, weight, out + r * hidden, hidden, eps);
}

template <typename T>
void rms_norm_heads(T* x, int64_t row_stride, const T* weight, int64_t rows, int64_t num_heads,
                    int64_t head_dim, float eps) {
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < num_heads; ++h) {
      T* head = x + r * row_stride + h * head_dim;
      normalize_row(head, weight, head, head_dim, eps);  // reads each lane before writing it
    }
}

template <typename T>
void add_rms_norm(T* x, T* residual, const T* weight, int64_t rows, int64_t hidden, float eps) {
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    T* x_row = x + r * hidden;
    T* res_row = residual + r * hidden;
    for (int64_t i = 0; i < hidden; i += kVecLanes) {
      const __m512 sum = _mm512_add_ps(load(res_row + i, hidden - i), load(x_row + i, hidden - i));
      store(res_row + i, sum, hidden - i);
    }
    normalize_row(res_row, weight, x_row, hidden, eps);
  }
}

// out = round(silu(gate)) * up, silu(g) = g / (1 + e^-g), as torch computes it in fp32.
template <typename T>
void silu_and_mul(const T* gate_up, T* out, int64_t rows, int64_t inter) {
  const __m512 one = _mm512_set1_ps(1.0f);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const T* gate = gate_up + r * 2 * inter;
    const T* up = gate + inter;
    T* out_row = out + r * inter;
    for (int64_t i = 0; i < inter; i += kVecLanes) {
      const __m512 g = load(gate + i, inter - i);
      const __m512 denominator = _mm512_add_ps(one, exp(_mm512_sub_ps(_mm512_setzero_ps(), g)));
      const __m512 activated = round<T>(_mm512_div_ps(g, denominator));
      store(out_row + i, _mm512_mul_ps(activated, load(up + i, inter - i)), inter - i);
    }
  }
}

// Per head, with h = head_dim / 2:
//   out[:h] = x[:h] cos[:h] - x[h:] sin[:h],   out[h:] = x[h:] cos[h:] + x[:h] sin[h:]
// each product and the sum rounded as torch rounds `x * cos + rotate_half(x) * sin`.
template <typename T>
void rotary_inplace(T* x, int64_t row_stride, const int64_t* positions, const T* cos,
                    const T* sin, int64_t rows, int64_t num_heads, int64_t head_dim) {
  const int64_t half = head_dim / 2;
  const __m512 zero = _mm512_setzero_ps();
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const T* c = cos + positions[r] * head_dim;
    const T* s = sin + positions[r] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      T* head = x + r * row_stride + h * head_dim;
      for (int64_t i = 0; i < half; i += kVecLanes) {
        const int64_t n = half - i;
        const __m512 lo = load(head + i, n), hi = load(head + half + i, n);
        const __m512 new_lo = _mm512_add_ps(round<T>(_mm512_mul_ps(lo, load(c + i, n))),
                                            round<T>(_mm512_mul_ps(_mm512_sub_ps(zero, hi),
                                                                   load(s + i, n))));
        const __m512 new_hi = _mm512_add_ps(round<T>(_mm512_mul_ps(hi, load(c + half + i, n))),
                                            round<T>(_mm512_mul_ps(lo, load(s + half + i, n))));
        store(head + i, new_lo, n);
        store(head + half + i, new_hi, n);
      }
    }
  }
}

template <typename T>
void store_kv(const T* key, const T* value, int64_t src_stride, T* key_cache, T* value_cache,
              const int64_t* slots, int64_t rows, int64_t width) {
  for (int64_t r = 0; r < rows; ++r) {
    std::memcpy(key_cache + slots[r] * width, key + r * src_stride, width * sizeof(T));
    std::memcpy(value_cache + slots[r] * width, value + r * src_stride, width * sizeof(T));
  }
}

#define METERSERVE_INSTANTIATE(T)                                                             \
  template void rms_norm<T>(const T*, const T*, T*, int64_t, int64_t, float);                 \
  template void rms_norm_heads<T>(T*, int64_t, const T*, int64_t, int64_t, int64_t, float);   \
  template void add_rms_norm<T>(T*, T*, const T*, int64_t, int64_t, float);                   \
  template void silu_and_mul<T>(const T*, T*, int64_t, int64_t);                              \
  template void rotary_inplace<T>(T*, int64_t, const int64_t*, const T*, const T*, int64_t,   \
                                  int64_t, int64_t);                                          \
  template void store_kv<T>(const T*, const T*, int64_t, T*, T*, const int64_t*, int64_t,     \
                            int64_t);

METERSERVE_INSTANTIATE(float)
METERSERVE_INSTANTIATE(bf16)

}  // namespace meterserve
