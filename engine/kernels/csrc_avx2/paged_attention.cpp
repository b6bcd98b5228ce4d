// Decode attention over a float32 paged cache on AVX2 (the float32 serving path of CPUs without
// AVX-512): each decode row reads its K/V where they lie, no gather copy and no padding to the
// longest request (the plain-torch backend gathers every decode's blocks into one padded tensor
// per layer, and that copy costs as much as the attention).
//
//   position t of request d lives at slot block_tables[d, t / block_size] * block_size
//                                        + t % block_size,   t in [lo, context_lens[d])
//   key_cache[slot, h, :] is that position's key for kv head h (same for value_cache);
//   lo = max(0, context_len - W) under a sliding window W > 0 (transformers' mask), else 0:
//   only the blocks holding visible positions are read.
//
// One work item is one (request, kv head): the `group` query heads that share the kv head (head
// q reads kv head q / group, as in HF's GQA) score every visible position (fp32 dot products,
// 8 lanes), take a softmax in fp32 (scores scaled; with a softcap c > 0, c * tanh(score / c)
// first, as Gemma 2), then sum the value rows. Scores stay in a thread-local buffer; K and V
// are each read once. Tested against engine/attention/reference.py (tests/unit/
// test_paged_attention_avx2.py).
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "avx2_kernels.h"
#include "gguf_formats.h"

namespace avx2 {
namespace {

struct Item {
  const float* query;  // [group, dim]: the item's query heads
  float* out;          // [group, dim]
  const int64_t* table;
  int64_t lo, length;  // visible positions [lo, length)
};

struct Cache {
  const float* keys;
  const float* values;
  int64_t kv_heads, dim, block_size;
  const float* row(const float* base, const int64_t* table, int64_t t, int64_t head) const {
    const int64_t slot = table[t / block_size] * block_size + t % block_size;
    return base + (slot * kv_heads + head) * dim;
  }
};

float dot(const float* a, const float* b, int64_t dim) {
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= dim; k += 16) {
    acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k + 8), _mm256_loadu_ps(b + k + 8), acc1);
  }
  if (k < dim) acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc0);
  return hsum(_mm256_add_ps(acc0, acc1));
}

// scores[(t - lo) * group + g] <- probability of position t for query head g, unnormalized;
// totals[g] <- their sum.
void softmax(float* scores, int64_t positions, int64_t group, float scale, float softcap,
             float* totals) {
  for (int64_t g = 0; g < group; ++g) {
    float max = -INFINITY;
    for (int64_t i = 0; i < positions; ++i) {
      float& x = scores[i * group + g];
      x *= scale;
      if (softcap > 0.0f) x = softcap * std::tanh(x / softcap);
      max = std::max(max, x);
    }
    float total = 0.0f;
    for (int64_t i = 0; i < positions; ++i) {
      float& x = scores[i * group + g];
      x = std::exp(x - max);
      total += x;
    }
    totals[g] = total;
  }
}

void attend(const Item& item, const Cache& cache, int64_t head, int64_t group, float scale,
            float softcap, std::vector<float>& scores) {
  const int64_t positions = item.length - item.lo, dim = cache.dim;
  scores.resize(std::max<size_t>(scores.size(), positions * group));
  for (int64_t t = item.lo; t < item.length; ++t) {
    const float* key = cache.row(cache.keys, item.table, t, head);
    for (int64_t g = 0; g < group; ++g)
      scores[(t - item.lo) * group + g] = dot(item.query + g * dim, key, dim);
  }
  std::vector<float> totals(group);
  softmax(scores.data(), positions, group, scale, softcap, totals.data());
  std::fill(item.out, item.out + group * dim, 0.0f);
  for (int64_t t = item.lo; t < item.length; ++t) {
    const float* value = cache.row(cache.values, item.table, t, head);
    for (int64_t g = 0; g < group; ++g) {
      const __m256 p = _mm256_set1_ps(scores[(t - item.lo) * group + g]);
      float* out = item.out + g * dim;
      for (int64_t k = 0; k < dim; k += 8)
        _mm256_storeu_ps(out + k,
                         _mm256_fmadd_ps(p, _mm256_loadu_ps(value + k), _mm256_loadu_ps(out + k)));
    }
  }
  for (int64_t g = 0; g < group; ++g) {
    const __m256 inverse = _mm256_set1_ps(1.0f / totals[g]);
    float* out = item.out + g * dim;
    for (int64_t k = 0; k < dim; k += 8)
      _mm256_storeu_ps(out + k, _mm256_mul_ps(_mm256_loadu_ps(out + k), inverse));
  }
}

}  // namespace

torch::Tensor paged_decode_attention_f32(const torch::Tensor& query, const torch::Tensor& key_cache,
                                         const torch::Tensor& value_cache,
                                         const torch::Tensor& block_tables,
                                         const torch::Tensor& context_lens, int64_t block_size,
                                         double scale, int64_t sliding_window, double softcap) {
  TORCH_CHECK(query.dim() == 3 && query.scalar_type() == torch::kFloat32 && query.is_contiguous(),
              "paged_decode_attention_f32: query must be contiguous float32 [decodes, heads, dim]");
  TORCH_CHECK(key_cache.dim() == 3 && key_cache.scalar_type() == torch::kFloat32 &&
                  key_cache.is_contiguous() && value_cache.sizes() == key_cache.sizes() &&
                  value_cache.scalar_type() == torch::kFloat32 && value_cache.is_contiguous(),
              "paged_decode_attention_f32: caches must be contiguous float32 [slots, kv_heads, "
              "dim] of one shape");
  const int64_t decodes = query.size(0), heads = query.size(1), dim = query.size(2);
  const int64_t kv_heads = key_cache.size(1);
  TORCH_CHECK(key_cache.size(2) == dim && dim % 8 == 0 && kv_heads > 0 && heads % kv_heads == 0,
              "paged_decode_attention_f32: head_dim must match the cache's and be a multiple of "
              "8, and heads a multiple of kv_heads");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == decodes &&
                  block_tables.scalar_type() == torch::kInt64 && block_tables.is_contiguous() &&
                  context_lens.numel() == decodes &&
                  context_lens.scalar_type() == torch::kInt64 && context_lens.is_contiguous(),
              "paged_decode_attention_f32: block_tables int64 [decodes, max_blocks] and "
              "context_lens int64 [decodes]");
  const int64_t max_blocks = block_tables.size(1), slots = key_cache.size(0);
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t d = 0; d < decodes; ++d) {
    TORCH_CHECK(lens[d] >= 1 && lens[d] <= max_blocks * block_size,
                "paged_decode_attention_f32: context_len out of range of its block table");
    for (int64_t b = 0; b < (lens[d] + block_size - 1) / block_size; ++b)
      TORCH_CHECK(tables[d * max_blocks + b] >= 0 &&
                      (tables[d * max_blocks + b] + 1) * block_size <= slots,
                  "paged_decode_attention_f32: a block id beyond the cache");
  }
  auto out = torch::empty_like(query);
  const int64_t group = heads / kv_heads;
  const Cache cache{key_cache.data_ptr<float>(), value_cache.data_ptr<float>(), kv_heads, dim,
                    block_size};
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
#pragma omp parallel
  {
    std::vector<float> scores;
#pragma omp for schedule(dynamic)
    for (int64_t i = 0; i < decodes * kv_heads; ++i) {
      const int64_t d = i / kv_heads, h = i % kv_heads;
      const int64_t lo = sliding_window > 0 ? std::max<int64_t>(0, lens[d] - sliding_window) : 0;
      const int64_t first = (d * heads + h * group) * dim;
      const Item item{q + first, o + first, tables + d * max_blocks, lo, lens[d]};
      attend(item, cache, h, group, static_cast<float>(scale), static_cast<float>(softcap),
             scores);
    }
  }
  return out;
}

}  // namespace avx2
