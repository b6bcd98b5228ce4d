// int8 x int8 linear layers: weights quantized per output channel at load, activations per row
// (token) at each call, int32 accumulation, the dequantizing epilogue fused.
//
// Decode is bound by streaming the weight: int8 halves bf16's bytes, and at larger batches
// AMX-INT8 has twice AMX-BF16's peak. One layout per weight serves every batch size and path
// (int8_pack_weight in kernels.h): 16 columns x 64 deep per 1 KB tile, four consecutive k of
// one column adjacent, which is both AMX's B-tile form for TDPBSSD and vpdpbusd's operand form:
//   packed[n_tile][k_tile][r][j][p] = weight[16 n_tile + j][64 k_tile + 4 r + p]
// Activations: symmetric int8 per row, q = round(x * (127 / max|x|)) clamped to [-127, 127],
// scale max|x| / 127 (0 for a zero row). The vpdpbusd path needs u8 activations: it uses
// q + 128 (q ^ 0x80) and subtracts 128 * sum_k weight[n, k] (row_sums), so both paths add the
// same exact int32 sum sum_k q[m, k] weight[n, k] and share one epilogue:
//   out[m, n] = fma(float(sum), x_scale[m] * weight_scale[n], bias[n]) rounded to bf16.
// Each row's result thus depends on that row alone, bit for bit, whatever the batch or path.
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int64_t kDepth = 64;        // int8 k per tile row group (16 tile rows x 4)
constexpr int64_t kTileBytes = 1024;  // 16 x 64 bytes
constexpr int64_t kBlock = 32;        // output columns per work item (two 16-column tiles)

// The shared epilogue: 16 columns [n, n + 16) of one row from their int32 sums.
inline void write_dequantized(__m512i sums, float x_scale, const Int8Weight& w,
                              const bf16* bias, int64_t n, bf16* out) {
  const __m512 scale = _mm512_mul_ps(_mm512_set1_ps(x_scale), _mm512_loadu_ps(w.scales + n));
  const __m512 b = bias ? load(bias + n) : _mm512_setzero_ps();
  store(out + n, _mm512_fmadd_ps(_mm512_cvtepi32_ps(sums), scale, b));
}

// Rows [0, M) of x_q (M <= 8) against columns [n0, n0 + 32) with vpdpbusd, streaming the two
// column tiles' weights once for all M rows.
template <int M>
void vnni_block(const int8_t* x_q, const float* x_scales, const Int8Weight& w, const bf16* bias,
                bf16* out, int64_t N, int64_t K, int64_t n0) {
  const int64_t k_tiles = K / kDepth;
  const int8_t* tile0 = w.packed + (n0 / 16) * k_tiles * kTileBytes;
  const int8_t* tile1 = tile0 + k_tiles * kTileBytes;
  const __m512i flip = _mm512_set1_epi32(int(0x80808080));  // s8 -> u8: q + 128
  __m512i acc[M][2];
  for (int m = 0; m < M; ++m) acc[m][0] = acc[m][1] = _mm512_setzero_si512();
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const int8_t* t0 = tile0 + kt * kTileBytes;
    const int8_t* t1 = tile1 + kt * kTileBytes;
    for (int r = 0; r < 16; ++r) {
      const __m512i w0 = _mm512_loadu_si512(t0 + r * 64);
      const __m512i w1 = _mm512_loadu_si512(t1 + r * 64);
      const int64_t k = kt * kDepth + 4 * r;
      for (int m = 0; m < M; ++m) {
        int32_t quad;
        std::memcpy(&quad, x_q + m * K + k, sizeof(quad));
        const __m512i a = _mm512_xor_si512(_mm512_set1_epi32(quad), flip);
        acc[m][0] = _mm512_dpbusd_epi32(acc[m][0], a, w0);
        acc[m][1] = _mm512_dpbusd_epi32(acc[m][1], a, w1);
      }
    }
  }
  for (int half = 0; half < 2; ++half) {
    const int64_t n = n0 + 16 * half;
    const __m512i shift = _mm512_slli_epi32(_mm512_loadu_si512(w.row_sums + n), 7);
    for (int m = 0; m < M; ++m)
      write_dequantized(_mm512_sub_epi32(acc[m][half], shift), x_scales[m], w, bias, n,
                        out + m * N);
  }
}

void vnni_rows(const int8_t* x_q, const float* x_scales, const Int8Weight& w, const bf16* bias,
               bf16* out, int64_t rows, int64_t N, int64_t K, int64_t n0) {
  switch (rows) {
    case 1: return vnni_block<1>(x_q, x_scales, w, bias, out, N, K, n0);
    case 2: return vnni_block<2>(x_q, x_scales, w, bias, out, N, K, n0);
    case 3: return vnni_block<3>(x_q, x_scales, w, bias, out, N, K, n0);
    case 4: return vnni_block<4>(x_q, x_scales, w, bias, out, N, K, n0);
    case 5: return vnni_block<5>(x_q, x_scales, w, bias, out, N, K, n0);
    case 6: return vnni_block<6>(x_q, x_scales, w, bias, out, N, K, n0);
    case 7: return vnni_block<7>(x_q, x_scales, w, bias, out, N, K, n0);
    default: return vnni_block<8>(x_q, x_scales, w, bias, out, N, K, n0);
  }
}

// Any number of rows on vpdpbusd: each thread takes 32-column blocks and runs every 8-row
// chunk over a block while its weights (32 x K bytes) sit in L2, so memory streams them once.
void vnni_linear(const int8_t* x_q, const float* x_scales, const Int8Weight& w, const bf16* bias,
                 bf16* out, int64_t M, int64_t N, int64_t K) {
#pragma omp parallel for schedule(static)
  for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
    for (int64_t m0 = 0; m0 < M; m0 += kSmallBatchRows) {
      vnni_rows(x_q + m0 * K, x_scales + m0, w, bias, out + m0 * N,
                std::min(kSmallBatchRows, M - m0), N, K, n0);
    }
  }
}

#ifdef __AMX_INT8__

constexpr int64_t kRowsPerChunk = 256;  // activation rows kept hot in L2

// One 32 x 32 block of int32 sums: rows [m0, m0 + 32) of x_q (padded), columns [n0, n0 + 32).
// Tiles: 0-3 accumulators (row half i, column half j -> 2 i + j), 4-5 x, 6-7 weight.
void amx_block(const int8_t* x_q, const int8_t* packed, int64_t K, int64_t m0, int64_t n0,
               int32_t* block) {
  const int64_t k_tiles = K / kDepth;
  const int8_t* weight0 = packed + (n0 / 16) * k_tiles * kTileBytes;
  const int8_t* weight1 = weight0 + k_tiles * kTileBytes;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    // Tile loads do not wake the hardware prefetcher (see amx_linear.cpp): fetch ahead.
    for (int line = 0; line < 16; ++line) {
      _mm_prefetch(reinterpret_cast<const char*>(weight0 + (kt + 8) * kTileBytes) + line * 64,
                   _MM_HINT_T1);
      _mm_prefetch(reinterpret_cast<const char*>(weight1 + (kt + 8) * kTileBytes) + line * 64,
                   _MM_HINT_T1);
    }
    _tile_loadd(4, x_q + m0 * K + kt * kDepth, K);
    _tile_loadd(5, x_q + (m0 + 16) * K + kt * kDepth, K);
    _tile_loadd(6, weight0 + kt * kTileBytes, 64);
    _tile_loadd(7, weight1 + kt * kTileBytes, 64);
    _tile_dpbssd(0, 4, 6);
    _tile_dpbssd(1, 4, 7);
    _tile_dpbssd(2, 5, 6);
    _tile_dpbssd(3, 5, 7);
  }
  const int64_t stride = kBlock * sizeof(int32_t);
  _tile_stored(0, block, stride);
  _tile_stored(1, block + 16, stride);
  _tile_stored(2, block + 16 * kBlock, stride);
  _tile_stored(3, block + 16 * kBlock + 16, stride);
}

void amx_int8_linear(const int8_t* x_q, const float* x_scales, const Int8Weight& w,
                     const bf16* bias, bf16* out, int64_t M, int64_t padded_rows, int64_t N,
                     int64_t K) {
  amx::TileConfig config;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64, config.rows[t] = 16;
  for (int64_t chunk = 0; chunk < padded_rows; chunk += kRowsPerChunk) {
    const int64_t chunk_end = std::min(padded_rows, chunk + kRowsPerChunk);
#pragma omp parallel
    {
      _tile_loadconfig(&config);  // tile state is per thread
      alignas(64) int32_t block[kBlock * kBlock];
#pragma omp for schedule(static)
      for (int64_t n0 = 0; n0 < N; n0 += kBlock) {
        for (int64_t m0 = chunk; m0 < chunk_end; m0 += kBlock) {
          amx_block(x_q, w.packed, K, m0, n0, block);
          for (int64_t r = 0; r < std::min(kBlock, M - m0); ++r) {
            bf16* row = out + (m0 + r) * N;
            for (int half = 0; half < 2; ++half)
              write_dequantized(_mm512_load_si512(block + r * kBlock + 16 * half),
                                x_scales[m0 + r], w, bias, n0 + 16 * half, row);
          }
        }
      }
      _tile_release();
    }
  }
}

#endif  // __AMX_INT8__

}  // namespace

bool amx_int8_available() {
#ifdef __AMX_INT8__
  return amx::permitted();
#else
  return false;
#endif
}

namespace {

constexpr int64_t kRotationBlock = 64;

// One 64-wide block in place (four vectors of 16): the orthonormal Hadamard transform, stage
// by stage as hadamard_blocks does. At stride h each pair (a, b) = (v[j], v[j + h]) becomes
// (a + b, a - b): within a vector (h = 1, 2, 4, 8) every lane takes its partner v[lane ^ h] and
// keeps self + partner where the lane's bit h is clear, partner - self where it is set; across
// vectors (h = 16, 32) whole vectors pair. The same fp32 adds per element, then * 1/8 (exact).
void hadamard_block(float* v) {
  __m512 r[4];
  for (int i = 0; i < 4; ++i) r[i] = _mm512_loadu_ps(v + 16 * i);
  const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int h = 1; h < 16; h *= 2) {
    const __m512i partner_of = _mm512_xor_si512(lane, _mm512_set1_epi32(h));
    const __mmask16 upper = _mm512_test_epi32_mask(lane, _mm512_set1_epi32(h));
    for (int i = 0; i < 4; ++i) {
      const __m512 partner = _mm512_permutexvar_ps(partner_of, r[i]);
      r[i] = _mm512_mask_sub_ps(_mm512_add_ps(r[i], partner), upper, partner, r[i]);
    }
  }
  for (int h = 1; h < 4; h *= 2)  // vectors i and i + h: strides 16 and 32
    for (int i = 0; i < 4; ++i)
      if ((i & h) == 0) {
        const __m512 a = r[i], b = r[i + h];
        r[i] = _mm512_add_ps(a, b);
        r[i + h] = _mm512_sub_ps(a, b);
      }
  const __m512 eighth = _mm512_set1_ps(0.125f);
  for (int i = 0; i < 4; ++i) _mm512_storeu_ps(v + 16 * i, _mm512_mul_ps(r[i], eighth));
}

// A row's values as they are quantized (see kernels.h), into values (fp32 [K]).
void prepare_row(const bf16* row, int64_t K, const float* inv_smooth, bool rotate,
                 float* values) {
  for (int64_t k = 0; k < K; k += kVecLanes) {
    const __m512 v = load(row + k);
    _mm512_storeu_ps(values + k, inv_smooth ? _mm512_mul_ps(v, _mm512_loadu_ps(inv_smooth + k)) : v);
  }
  if (rotate)
    for (int64_t k = 0; k < K; k += kRotationBlock) hadamard_block(values + k);
}

}  // namespace

void quantize_rows(const bf16* x, int64_t M, int64_t K, int8_t* x_q, float* scales,
                   const float* inv_smooth, bool rotate) {
  if (rotate && K % kRotationBlock != 0)
    throw std::invalid_argument("quantize_rows: rotating needs K % 64 == 0");
#pragma omp parallel if (M * K >= (int64_t(1) << 16))
  {
    std::vector<float> values(K);
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      prepare_row(x + m * K, K, inv_smooth, rotate, values.data());
      __m512 peak = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; k += kVecLanes)
        peak = _mm512_max_ps(peak, _mm512_abs_ps(_mm512_loadu_ps(values.data() + k)));
      const float amax = _mm512_reduce_max_ps(peak);
      const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
      scales[m] = amax / 127.0f;
      const __m512 vinv = _mm512_set1_ps(inv);
      const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127);
      for (int64_t k = 0; k < K; k += kVecLanes) {
        // cvtps rounds to nearest even (the default MXCSR mode), as torch.round does.
        __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(values.data() + k), vinv));
        q = _mm512_min_epi32(_mm512_max_epi32(q, lo), hi);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(x_q + m * K + k), _mm512_cvtepi32_epi8(q));
      }
    }
  }
}

void int8_linear(const int8_t* x_q, const float* x_scales, const Int8Weight& weight,
                 const bf16* bias, bf16* out, int64_t M, int64_t padded_rows, int64_t N,
                 int64_t K, bool use_amx) {
  if (use_amx && !amx_int8_available())
    throw std::runtime_error("int8_linear: AMX-INT8 is not available to this process");
#ifdef __AMX_INT8__
  if (use_amx && M > kSmallBatchRows) {
    return amx_int8_linear(x_q, x_scales, weight, bias, out, M, padded_rows, N, K);
  }
#endif
  (void)padded_rows;
  vnni_linear(x_q, x_scales, weight, bias, out, M, N, K);
}

}  // namespace meterserve
