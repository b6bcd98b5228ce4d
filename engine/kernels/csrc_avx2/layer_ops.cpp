// A decoder layer's row-wise operations in float32 on AVX2, under the native module's names and
// signatures (csrc/elementwise.cpp, which does them with AVX-512 and bf16 rounding), so
// engine/models/layer_ops.py's KernelLayerOps runs a float32 model on either module.
//
// At decode batch sizes every torch op costs more in dispatch and allocation than in
// arithmetic (torch's float32 RMSNorm of one 2,048-wide row took ~0.1 ms on a 2-core AMD EPYC
// Zen 3, five ops); one pass per row here does the work of 4-8 ops. The sums run in fp32 in
// another order than torch's: tested against TorchLayerOps with a tolerance
// (tests/unit/test_layer_ops_avx2.py).
#include <immintrin.h>
#include <torch/extension.h>

#include <cmath>
#include <cstdint>

#include "avx2_kernels.h"
#include "gguf_formats.h"

namespace avx2 {
namespace {

// Forking threads costs microseconds; only batches with this many rows are split.
constexpr int64_t kParallelRows = 16;

// e^x, |error| ~2 ulp: x = n ln 2 + r, e^r by its Taylor polynomial to degree 6, times 2^n.
inline __m256 exp256(__m256 x) {
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.3f)), _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.0f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i exponent = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(exponent));
}

// out = weight * (x / rms(x)), rms over `hidden` elements in fp32.
void normalize_row(const float* x, const float* weight, float* out, int64_t hidden, float eps) {
  __m256 sum_squares = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= hidden; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    sum_squares = _mm256_fmadd_ps(v, v, sum_squares);
  }
  float total = hsum(sum_squares);
  for (int64_t j = i; j < hidden; ++j) total += x[j] * x[j];
  const float inv_rms = 1.0f / std::sqrt(total / static_cast<float>(hidden) + eps);
  const __m256 scale = _mm256_set1_ps(inv_rms);
  for (i = 0; i + 8 <= hidden; i += 8) {
    const __m256 normed = _mm256_mul_ps(_mm256_loadu_ps(x + i), scale);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_loadu_ps(weight + i), normed));
  }
  for (; i < hidden; ++i) out[i] = weight[i] * (x[i] * inv_rms);
}

void check_float(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat32, what, ": float32 only (AVX2 kernels)");
}

void check_rows(const torch::Tensor& x, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, what, " must be [rows, width] with unit stride");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  TORCH_CHECK(x.is_contiguous() && weight.is_contiguous(), "rms_norm: contiguous inputs only");
  check_float(x, "rms_norm");
  check_float(weight, "rms_norm");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  TORCH_CHECK(weight.numel() == hidden, "rms_norm: weight must have x's last size");
  auto out = torch::empty_like(x);
  const float *in = x.data_ptr<float>(), *w = weight.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r)
    normalize_row(in + r * hidden, w, o + r * hidden, hidden, static_cast<float>(eps));
  return out;
}

// Heads [first_column / head_dim, + num_heads) of every row of x [rows, width], in place.
void rms_norm_heads_(torch::Tensor& x, int64_t first_column, const torch::Tensor& weight,
                     int64_t num_heads, double eps) {
  check_rows(x, "rms_norm_heads_: x");
  check_float(x, "rms_norm_heads_");
  check_float(weight, "rms_norm_heads_");
  const int64_t head_dim = weight.numel();
  TORCH_CHECK(weight.is_contiguous() && first_column >= 0 && num_heads >= 0 &&
                  first_column + num_heads * head_dim <= x.size(1),
              "rms_norm_heads_: heads past the end of the row");
  float* data = x.data_ptr<float>() + first_column;
  const float* w = weight.data_ptr<float>();
  const int64_t rows = x.size(0), stride = x.stride(0);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t h = 0; h < num_heads; ++h) {
      float* head = data + r * stride + h * head_dim;
      normalize_row(head, w, head, head_dim, static_cast<float>(eps));  // reads before writing
    }
}

// residual <- residual + x; x <- rms_norm(residual) * weight. Both in place, per row.
void add_rms_norm_(torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight,
                   double eps) {
  TORCH_CHECK(x.is_contiguous() && residual.is_contiguous() && weight.is_contiguous(),
              "add_rms_norm: contiguous inputs only");
  TORCH_CHECK(x.sizes() == residual.sizes(), "add_rms_norm: x and residual shapes differ");
  check_float(x, "add_rms_norm");
  check_float(residual, "add_rms_norm");
  check_float(weight, "add_rms_norm");
  const int64_t hidden = x.size(-1), rows = x.numel() / hidden;
  float *xs = x.data_ptr<float>(), *res = residual.data_ptr<float>();
  const float* w = weight.data_ptr<float>();
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    float* x_row = xs + r * hidden;
    float* res_row = res + r * hidden;
    for (int64_t i = 0; i < hidden; ++i) res_row[i] += x_row[i];
    normalize_row(res_row, w, x_row, hidden, static_cast<float>(eps));
  }
}

// out[r, :] = silu(gate_up[r, :inter]) * gate_up[r, inter:], silu(g) = g / (1 + e^-g).
torch::Tensor silu_and_mul(const torch::Tensor& gate_up) {
  TORCH_CHECK(gate_up.is_contiguous() && gate_up.size(-1) % 2 == 0,
              "silu_and_mul: contiguous [..., 2 * intermediate] input");
  check_float(gate_up, "silu_and_mul");
  const int64_t inter = gate_up.size(-1) / 2, rows = gate_up.numel() / (2 * inter);
  auto sizes = gate_up.sizes().vec();
  sizes.back() = inter;
  auto out = torch::empty(sizes, gate_up.options());
  const float* in = gate_up.data_ptr<float>();
  float* o = out.data_ptr<float>();
  const __m256 one = _mm256_set1_ps(1.0f);
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const float* gate = in + r * 2 * inter;
    const float* up = gate + inter;
    float* out_row = o + r * inter;
    int64_t i = 0;
    for (; i + 8 <= inter; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 denominator = _mm256_add_ps(one, exp256(_mm256_sub_ps(_mm256_setzero_ps(), g)));
      _mm256_storeu_ps(out_row + i,
                       _mm256_mul_ps(_mm256_div_ps(g, denominator), _mm256_loadu_ps(up + i)));
    }
    for (; i < inter; ++i) out_row[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
  }
  return out;
}

// Rotate-half RoPE in place on the first num_heads heads of each row, with h = head_dim / 2:
//   out[:h] = x[:h] cos[:h] - x[h:] sin[:h],   out[h:] = x[h:] cos[h:] + x[:h] sin[h:]
// cos and sin: the whole tables [positions, head_dim], row positions[r] for row r.
void rotary_(torch::Tensor& x, const torch::Tensor& positions, const torch::Tensor& cos,
             const torch::Tensor& sin, int64_t num_heads, int64_t head_dim) {
  check_rows(x, "rotary x");
  check_float(x, "rotary");
  check_float(cos, "rotary");
  check_float(sin, "rotary");
  TORCH_CHECK(x.size(1) >= num_heads * head_dim && head_dim % 2 == 0,
              "rotary: x must be [rows, >= heads * dim], dim even");
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
                  positions.numel() == x.size(0),
              "rotary: positions must be int64 [rows]");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(-1) == head_dim &&
                  sin.sizes() == cos.sizes(),
              "rotary: cos/sin must be contiguous [positions, head_dim]");
  const int64_t rows = x.size(0), stride = x.stride(0), half = head_dim / 2;
  const int64_t table_rows = cos.numel() / head_dim;
  const int64_t* pos = positions.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(pos[r] >= 0 && pos[r] < table_rows, "rotary: a position past the tables");
  float* data = x.data_ptr<float>();
  const float *cos_table = cos.data_ptr<float>(), *sin_table = sin.data_ptr<float>();
#pragma omp parallel for if (rows >= kParallelRows)
  for (int64_t r = 0; r < rows; ++r) {
    const float* c = cos_table + pos[r] * head_dim;
    const float* s = sin_table + pos[r] * head_dim;
    for (int64_t h = 0; h < num_heads; ++h) {
      float* head = data + r * stride + h * head_dim;
      int64_t i = 0;
      for (; i + 8 <= half; i += 8) {
        const __m256 lo = _mm256_loadu_ps(head + i), hi = _mm256_loadu_ps(head + half + i);
        const __m256 new_lo = _mm256_sub_ps(_mm256_mul_ps(lo, _mm256_loadu_ps(c + i)),
                                            _mm256_mul_ps(hi, _mm256_loadu_ps(s + i)));
        const __m256 new_hi = _mm256_add_ps(_mm256_mul_ps(hi, _mm256_loadu_ps(c + half + i)),
                                            _mm256_mul_ps(lo, _mm256_loadu_ps(s + half + i)));
        _mm256_storeu_ps(head + i, new_lo);
        _mm256_storeu_ps(head + half + i, new_hi);
      }
      for (; i < half; ++i) {
        const float lo = head[i], hi = head[half + i];
        head[i] = lo * c[i] - hi * s[i];
        head[half + i] = hi * c[half + i] + lo * s[half + i];
      }
    }
  }
}

}  // namespace avx2
