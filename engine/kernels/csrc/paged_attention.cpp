// Decode attention that reads K/V where they lie in the paged cache.
//
// One work item = (request d, kv head h): the `group` query heads that share kv head h
// (query head q reads kv head q / group, as in HF's GQA) score all context positions, take a
// softmax in fp32, and sum the values. No gather copy, no padding to the longest request.
//
//   position t of request d lives at slot block_tables[d, t / block_size] * block_size
//                                        + t % block_size,   t in [0, context_lens[d])
//   key_cache[slot, h, :] is that position's key for kv head h (same for value_cache).
//
// Requires head_dim % 16 == 0 and head_dim <= 256 (checked by the binding).
#include <algorithm>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr int kMaxDimVectors = 16;  // head_dim <= 256

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group, dim_vectors, slot_stride;
};

inline int64_t slot_of(const int64_t* table, int64_t t, int64_t block_size) {
  return table[t / block_size] * block_size + t % block_size;
}

// scores[g * length + t] = scale * q_g . k_t for the group's query heads g.
template <typename T>
void score_keys(const std::vector<__m512>& q, const T* key_cache, const int64_t* table,
                int64_t length, int64_t h, const Shape& s, float* scores) {
  for (int64_t t = 0; t < length; ++t) {
    const T* key = key_cache + slot_of(table, t, s.block_size) * s.slot_stride + h * s.head_dim;
    __m512 k[kMaxDimVectors];
    for (int64_t j = 0; j < s.dim_vectors; ++j) k[j] = load(key + j * kVecLanes);
    for (int64_t g = 0; g < s.group; ++g) {
      __m512 acc = _mm512_mul_ps(q[g * s.dim_vectors], k[0]);
      for (int64_t j = 1; j < s.dim_vectors; ++j)
        acc = _mm512_fmadd_ps(q[g * s.dim_vectors + j], k[j], acc);
      scores[g * length + t] = _mm512_reduce_add_ps(acc);
    }
  }
}

// In place: row <- exp(row - max(row)); returns the row's sum.
float exp_and_sum(float* row, int64_t length) {
  __m512 peak = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < length; t += kVecLanes)
    peak = _mm512_mask_max_ps(peak, lanes(length - t), peak, load(row + t, length - t));
  const __m512 shift = _mm512_set1_ps(_mm512_reduce_max_ps(peak));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < length; t += kVecLanes) {
    const __m512 e = exp(_mm512_sub_ps(load(row + t, length - t), shift));
    sum = _mm512_mask_add_ps(sum, lanes(length - t), sum, e);
    store(row + t, e, length - t);
  }
  return _mm512_reduce_add_ps(sum);
}

template <typename T>
void attend(const T* query, const T* key_cache, const T* value_cache, const int64_t* table,
            int64_t length, int64_t h, const Shape& s, float scale, T* out) {
  const int64_t dv = s.dim_vectors;
  std::vector<__m512> q(s.group * dv);
  for (int64_t g = 0; g < s.group; ++g)
    for (int64_t j = 0; j < dv; ++j)
      q[g * dv + j] = _mm512_mul_ps(load(query + (h * s.group + g) * s.head_dim + j * kVecLanes),
                                    _mm512_set1_ps(scale));
  std::vector<float> scores(s.group * length);
  score_keys(q, key_cache, table, length, h, s, scores.data());
  std::vector<float> total(s.group);
  for (int64_t g = 0; g < s.group; ++g) total[g] = exp_and_sum(&scores[g * length], length);

  std::vector<__m512> acc(s.group * dv, _mm512_setzero_ps());
  for (int64_t t = 0; t < length; ++t) {
    const T* value =
        value_cache + slot_of(table, t, s.block_size) * s.slot_stride + h * s.head_dim;
    __m512 v[kMaxDimVectors];
    for (int64_t j = 0; j < dv; ++j) v[j] = load(value + j * kVecLanes);
    for (int64_t g = 0; g < s.group; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * length + t]);
      for (int64_t j = 0; j < dv; ++j) acc[g * dv + j] = _mm512_fmadd_ps(p, v[j], acc[g * dv + j]);
    }
  }
  for (int64_t g = 0; g < s.group; ++g) {
    const __m512 inv_total = _mm512_set1_ps(1.0f / total[g]);
    T* dst = out + (h * s.group + g) * s.head_dim;
    for (int64_t j = 0; j < dv; ++j)
      store(dst + j * kVecLanes, _mm512_mul_ps(acc[g * dv + j], inv_total));
  }
}

}  // namespace

template <typename T>
void paged_decode_attention(const T* query, int64_t query_stride, const T* key_cache,
                            const T* value_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, T* out,
                            int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale) {
  const Shape s{num_heads,  num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
                head_dim / kVecLanes, num_kv_heads * head_dim};
  const int64_t items = num_decodes * num_kv_heads;
#pragma omp parallel for schedule(dynamic) if (items > 1)
  for (int64_t item = 0; item < items; ++item) {
    const int64_t d = item / num_kv_heads, h = item % num_kv_heads;
    attend(query + d * query_stride, key_cache, value_cache, block_tables + d * max_blocks,
           context_lens[d], h, s, scale, out + d * num_heads * head_dim);
  }
}

#define METERSERVE_INSTANTIATE(T)                                                              \
  template void paged_decode_attention<T>(const T*, int64_t, const T*, const T*, const int64_t*, \
                                          int64_t, const int64_t*, T*, int64_t, int64_t,       \
                                          int64_t, int64_t, int64_t, float);

METERSERVE_INSTANTIATE(float)
METERSERVE_INSTANTIATE(bf16)

}  // namespace meterserve
