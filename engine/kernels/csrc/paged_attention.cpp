// Decode attention that reads K/V where they lie in the paged cache.
//
// One request's query token: every query head scores the context positions it sees, takes a
// softmax in fp32 and sums the values (query head q reads kv head q / group, as in HF's GQA).
// No gather copy, no padding to the longest request.
//
// It sees every position, or under a sliding window W > 0 the last W ([context_len - W,
// context_len), transformers' mask); only the blocks holding those are read, so a small window
// over a long context costs the window. A softcap c > 0 turns the scaled scores into
// c * tanh(score / c) before the softmax (Gemma 2). With neither, the arithmetic is that of the
// plain kernel, operation for operation.
//
//   position t of request d lives at slot block_tables[d, t / block_size] * block_size
//                                        + t % block_size,   t in [0, context_lens[d])
//   key_cache[slot, h, :] is that position's key for kv head h (same for value_cache).
//
// Requires head_dim % 16 == 0 and head_dim <= 256 (checked by the binding).
//
// Why it is shaped this way: decode attention does few flops per byte of K/V, so the goal is
// to stream K and V at memory speed with the arithmetic hidden under the streaming.
//  - Two passes per work item: all scores, one softmax, then all values. K and V are each
//    read once; the scores ([position][query head], a few KB) stay in L1/L2.
//  - Positions go 16 at a time (a "tile"). Scores of a tile are one AMX matrix product per
//    kv head where the CPU has AMX and the shape allows (paged_attention_amx.h). Otherwise
//    (AVX-512) the 16 dot products of one query head end as 16 vectors of partial sums that
//    one transpose-and-add tree (sum_lanes) turns into 16 scores, instead of 16 horizontal
//    reductions; bf16 keys meet the bf16 query in _mm512_dpbf16_ps (bf16 products are exact
//    in fp32, so this equals widening both, minus the conversions).
//  - bf16 values widen with one shift (even dims) and one mask (odd dims) per 32 elements, no
//    shuffle; even and odd dims accumulate apart and are interleaved back on the output
//    store. Probabilities, accumulators and the softmax stay fp32.
//  - With enough requests a work item is a whole request with all kv heads: a block of the
//    cache is then one contiguous run (slots x kv heads x dim). Software prefetch runs a few
//    rows ahead, spread between pieces of arithmetic (see Prefetcher).
//  - Buffers are thread-local and only grow: no allocation per item.
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "kernels.h"
#include "paged_attention_amx.h"
#include "paged_attention_common.h"
#include "paged_attention_scores.h"
#include "vec.h"

namespace meterserve {
namespace {

using namespace attention;  // paged_attention_common.h, paged_attention_scores.h

// ---- scores, AMX -------------------------------------------------------------------------

#ifdef __AMX_BF16__
bool amx_fits(const Shape& s) {
  return s.head_dim % 32 == 0 && s.block_size % kTile == 0 && s.group <= 16 &&
         amx::permitted();
}

// score_keys on AMX, one tile product per (tile, kv head); requires amx_fits.
void score_keys_amx(const bf16* query, const bf16* key_cache, const int64_t* offsets,
                    int64_t padded, const Item& item, const Shape& s,
                    Prefetcher<bf16>& prefetch, uint32_t* pairs, float* scores, int64_t row) {
  const int64_t pairs_per_kv_head = s.group * s.head_dim / 2;
  for (int64_t h = item.kv_begin; h < item.kv_end; ++h) {
    const int64_t i = (h - item.kv_begin) * s.group;  // the kv head's first query head
    amx::query_pairs(query + (item.kv_begin * s.group + i) * s.head_dim, s.group, s.head_dim,
                     pairs + (h - item.kv_begin) * pairs_per_kv_head);
  }
  amx::configure_score_tiles(s.group);
  const int64_t budget = kTile / (item.kv_end - item.kv_begin) + 2;
  const int64_t key_stride = s.slot_stride * sizeof(bf16);
  int64_t n = 0;  // tile products so far: alternates the C register
  for (int64_t t = 0; t < padded; t += kTile) {  // positions [t, t + 16): one block's slots
    for (int64_t h = item.kv_begin; h < item.kv_end; ++h, ++n) {
      const int64_t i = (h - item.kv_begin) * s.group;
      prefetch.advance(t + kTile + kPrefetchRows, budget);
      const bf16* keys = key_cache + offsets[t] + h * s.head_dim;
      const uint32_t* q = pairs + (h - item.kv_begin) * pairs_per_kv_head;
      float* out = scores + t * row + i;
      if (n & 1)
        amx::score_tile<1>(keys, key_stride, q, s.head_dim, s.group, out, row);
      else
        amx::score_tile<0>(keys, key_stride, q, s.head_dim, s.group, out, row);
    }
  }
  amx::release_tiles();
}
#endif

// ---- softmax -----------------------------------------------------------------------------

// In place over score rows (position t's at scores + t * row), per head i < heads:
// rows [lo, length) <- exp(scale * (score - max)), the other rows of [0, padded) <- 0 (never
// read: they may hold anything), totals[i] = the sum. scale > 0, so the max of the raw scores
// is the max of the scaled ones. With a softcap, softmax_capped_rows instead.
void softmax_rows(float* scores, int64_t lo, int64_t length, int64_t padded, int64_t heads,
                  int64_t row, float scale, float* totals) {
  const __m512 factor = _mm512_set1_ps(scale);
  for (int64_t i = 0; i < heads; i += kVecLanes) {  // heads [i, i + 16)
    const __mmask16 mask = lanes(heads - i);
    for (int64_t t = 0; t < lo; ++t)
      _mm512_mask_storeu_ps(scores + t * row + i, mask, _mm512_setzero_ps());
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t t = lo; t < length; ++t)
      peak = _mm512_max_ps(peak, _mm512_maskz_loadu_ps(mask, scores + t * row + i));
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = lo; t < length; ++t) {
      float* r = scores + t * row + i;
      const __m512 e =
          exp(_mm512_mul_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, r), peak), factor));
      sum = _mm512_add_ps(sum, e);
      _mm512_mask_storeu_ps(r, mask, e);
    }
    for (int64_t t = length; t < padded; ++t)
      _mm512_mask_storeu_ps(scores + t * row + i, mask, _mm512_setzero_ps());
    _mm512_mask_storeu_ps(totals + i, mask, sum);
  }
}

// softmax_rows over capped scores x = softcapped(scale * score): rows [lo, length) <-
// exp(x - max x), capped in a first pass that also finds the max.
void softmax_capped_rows(float* scores, int64_t lo, int64_t length, int64_t padded,
                         int64_t heads, int64_t row, const Scoring& scoring, float* totals) {
  const __m512 factor = _mm512_set1_ps(scoring.scale);
  for (int64_t i = 0; i < heads; i += kVecLanes) {  // heads [i, i + 16)
    const __mmask16 mask = lanes(heads - i);
    for (int64_t t = 0; t < lo; ++t)
      _mm512_mask_storeu_ps(scores + t * row + i, mask, _mm512_setzero_ps());
    __m512 peak = _mm512_set1_ps(-INFINITY);
    for (int64_t t = lo; t < length; ++t) {
      float* r = scores + t * row + i;
      const __m512 x =
          softcapped(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, r), factor), scoring.softcap);
      peak = _mm512_max_ps(peak, x);
      _mm512_mask_storeu_ps(r, mask, x);
    }
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = lo; t < length; ++t) {
      float* r = scores + t * row + i;
      const __m512 e = exp(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, r), peak));
      sum = _mm512_add_ps(sum, e);
      _mm512_mask_storeu_ps(r, mask, e);
    }
    for (int64_t t = length; t < padded; ++t)
      _mm512_mask_storeu_ps(scores + t * row + i, mask, _mm512_setzero_ps());
    _mm512_mask_storeu_ps(totals + i, mask, sum);
  }
}

// ---- values ------------------------------------------------------------------------------

// One step of a value row widened to fp32 vectors. bf16: 32 dims as (even dims, odd dims),
// which is also how the accumulators of a step are laid out.
template <typename T>
struct ValueStep;

template <>
struct ValueStep<float> {
  static constexpr int64_t kDims = 16, kVectors = 1;
  template <bool kFull>
  static void widen(const float* value, __mmask32, __m512 (&out)[kVectors]) {
    out[0] = _mm512_loadu_ps(value);
  }
};

// 32 bf16 as fp32: the even elements (low halves of the 32-bit lanes), the odd ones (high).
inline __m512 even_elements(__m512i v) { return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)); }
inline __m512 odd_elements(__m512i v) {
  return _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32(int(0xFFFF0000))));
}

template <>
struct ValueStep<bf16> {
  static constexpr int64_t kDims = 32, kVectors = 2;
  template <bool kFull>
  static void widen(const bf16* value, __mmask32 mask, __m512 (&out)[kVectors]) {
    const __m512i v = kFull ? _mm512_loadu_si512(value) : _mm512_maskz_loadu_epi16(mask, value);
    out[0] = even_elements(v);
    out[1] = odd_elements(v);
  }
};

// acc[g] += sum over the tile's positions t of probs[t * prob_stride + g] * value(t), for
// kHeads query heads g (accumulator rows acc_stride apart), dims [0, kDims) of one step.
template <typename T, int kHeads, bool kFull>
void add_value_step(const T* values, const int64_t* offsets, __mmask32 mask, const float* probs,
                    int64_t prob_stride, float* acc, int64_t acc_stride) {
  using Step = ValueStep<T>;
  __m512 sum[kHeads][Step::kVectors];
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < Step::kVectors; ++j)
      sum[g][j] = _mm512_loadu_ps(acc + g * acc_stride + j * kVecLanes);
  for (int t = 0; t < kTile; ++t) {
    __m512 v[Step::kVectors];
    Step::template widen<kFull>(values + offsets[t], mask, v);
    for (int g = 0; g < kHeads; ++g) {
      const __m512 p = _mm512_set1_ps(probs[t * prob_stride + g]);
      for (int j = 0; j < Step::kVectors; ++j) sum[g][j] = _mm512_fmadd_ps(p, v[j], sum[g][j]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < Step::kVectors; ++j)
      _mm512_storeu_ps(acc + g * acc_stride + j * kVecLanes, sum[g][j]);
}

// 64 dims of a value row as 4 fp32 vectors, laid out as the accumulators (bf16: two steps of
// (even, odd) dims). Four vectors per head give the FMAs of a tile more independent chains
// than one step does.
template <typename T>
inline void widen_chunk(const T* value, __m512 (&out)[4]);

template <>
inline void widen_chunk(const float* value, __m512 (&out)[4]) {
  for (int j = 0; j < 4; ++j) out[j] = _mm512_loadu_ps(value + j * kVecLanes);
}

template <>
inline void widen_chunk(const bf16* value, __m512 (&out)[4]) {
  for (int j = 0; j < 2; ++j) {  // dims [32 j, 32 j + 32)
    const __m512i v = _mm512_loadu_si512(value + j * 32);
    out[2 * j] = even_elements(v);
    out[2 * j + 1] = odd_elements(v);
  }
}

// add_value_step over dims [0, 64).
template <typename T, int kHeads>
void add_value_chunk(const T* values, const int64_t* offsets, const float* probs,
                     int64_t prob_stride, float* acc, int64_t acc_stride) {
  __m512 sum[kHeads][4];
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < 4; ++j) sum[g][j] = _mm512_loadu_ps(acc + g * acc_stride + j * kVecLanes);
  for (int t = 0; t < kTile; ++t) {
    __m512 v[4];
    widen_chunk(values + offsets[t], v);
    for (int g = 0; g < kHeads; ++g) {
      const __m512 p = _mm512_set1_ps(probs[t * prob_stride + g]);
      for (int j = 0; j < 4; ++j) sum[g][j] = _mm512_fmadd_ps(p, v[j], sum[g][j]);
    }
  }
  for (int g = 0; g < kHeads; ++g)
    for (int j = 0; j < 4; ++j) _mm512_storeu_ps(acc + g * acc_stride + j * kVecLanes, sum[g][j]);
}

// The tile's values for kHeads query heads, all of head_dim: 64-dim chunks, then steps.
template <typename T, int kHeads>
void value_tile(const T* values, const int64_t* offsets, int64_t head_dim, const float* probs,
                int64_t prob_stride, float* acc, int64_t acc_stride) {
  using Step = ValueStep<T>;
  int64_t c = 0;
  for (; c + 64 <= head_dim; c += 64)  // dims [c, c + 64)
    add_value_chunk<T, kHeads>(values + c, offsets, probs, prob_stride, acc + c, acc_stride);
  for (; c < head_dim; c += Step::kDims) {  // dims [c, c + kDims)
    const __mmask32 mask = lanes32(head_dim - c);
    if (head_dim - c >= Step::kDims)
      add_value_step<T, kHeads, true>(values + c, offsets, mask, probs, prob_stride, acc + c,
                                      acc_stride);
    else
      add_value_step<T, kHeads, false>(values + c, offsets, mask, probs, prob_stride, acc + c,
                                       acc_stride);
  }
}

// value_tile for `heads` query heads that read the same kv head, up to kMaxHeadTile at once.
template <typename T>
void value_tile_heads(const T* values, const int64_t* offsets, int64_t head_dim, int64_t heads,
                      const float* probs, int64_t prob_stride, float* acc, int64_t acc_stride) {
  for (int64_t g = 0; g < heads; g += kMaxHeadTile) {  // query heads [g, g + 4)
    const float* p = probs + g;
    float* a = acc + g * acc_stride;
    switch (std::min<int64_t>(kMaxHeadTile, heads - g)) {
      case 4: value_tile<T, 4>(values, offsets, head_dim, p, prob_stride, a, acc_stride); break;
      case 3: value_tile<T, 3>(values, offsets, head_dim, p, prob_stride, a, acc_stride); break;
      case 2: value_tile<T, 2>(values, offsets, head_dim, p, prob_stride, a, acc_stride); break;
      default: value_tile<T, 1>(values, offsets, head_dim, p, prob_stride, a, acc_stride);
    }
  }
}

// out = acc * inv_total, rounded to T. bf16: each 32-dim step of acc holds (even, odd) dims.
void store_output(const float* acc, float inv_total, int64_t head_dim, float* out) {
  const __m512 scale = _mm512_set1_ps(inv_total);
  for (int64_t c = 0; c < head_dim; c += kVecLanes)  // dims [c, c + 16)
    _mm512_storeu_ps(out + c, _mm512_mul_ps(_mm512_loadu_ps(acc + c), scale));
}

void store_output(const float* acc, float inv_total, int64_t head_dim, bf16* out) {
  const __m512 scale = _mm512_set1_ps(inv_total);
  for (int64_t c = 0; c < head_dim; c += 32) {  // dims [c, c + 32)
    const __m512i even = bf16_rounded_bits(_mm512_mul_ps(_mm512_loadu_ps(acc + c), scale));
    const __m512i odd =
        bf16_rounded_bits(_mm512_mul_ps(_mm512_loadu_ps(acc + c + kVecLanes), scale));
    _mm512_mask_storeu_epi16(out + c, lanes32(head_dim - c),
                             _mm512_or_si512(odd, _mm512_srli_epi32(even, 16)));
  }
}

// ---- one work item -----------------------------------------------------------------------

// Attention of request item.d's query heads that read kv heads [item.kv_begin, item.kv_end).
// The query at position length - 1 sees positions [first, length); the item works on
// positions [begin, begin + padded), begin = first rounded down to a tile (tiles start on a
// multiple of 16, so AMX tiles stay inside a block), local index u = position - begin. Blocks
// before begin's are never read: a small window over a long context costs only the window.
template <typename T>
void attend(const Batch<T>& b, const Item& item, const Shape& s, const Scoring& scoring) {
  const int64_t length = b.context_lens[item.d];
  const T* query = b.query + item.d * b.query_stride;
  const int64_t first_head = item.kv_begin * s.group;
  const int64_t heads = (item.kv_end - item.kv_begin) * s.group;
  T* out = b.out + (item.d * s.num_heads + first_head) * s.head_dim;
  if (length == 0) {  // nothing to attend to: zeros rather than 0 / 0
    std::fill_n(out, heads * s.head_dim, T{});
    return;
  }
  const int64_t first = first_visible(length - 1, scoring.window);
  const int64_t begin = first / kTile * kTile;
  const int64_t padded = round_up(length - begin, kTile);
  const int64_t acc_stride = round_up(s.head_dim, 32);  // bf16 steps are 32 dims wide
  Scratch& w = scratch();
  int64_t* offsets = grown(w.offsets, padded);
  // Score rows padded to whole vectors: a row's vector stores never overlap the next row's
  // loads (overlap defeats store-to-load forwarding; measured 3x slower softmax).
  const int64_t row = round_up(heads, kVecLanes);
  float* scores = grown(w.scores, padded * row);
  float* acc = grown(w.acc, heads * acc_stride);
  float* totals = grown(w.totals, heads);
  slot_offsets(b.block_tables + item.d * b.max_blocks, begin, first, length, padded, s, offsets);
  std::fill_n(acc, heads * acc_stride, 0.0f);
  const int64_t row_begin = item.kv_begin * s.head_dim;  // the item's part of a slot row
  const int64_t row_bytes = (item.kv_end - item.kv_begin) * s.head_dim * sizeof(T);
  Prefetcher<T> prefetch(b.key_cache + row_begin, b.value_cache + row_begin, offsets, padded,
                         row_bytes);

  bool scored = false;
#ifdef __AMX_BF16__
  if constexpr (std::is_same_v<T, bf16>) {
    if (amx_fits(s)) {
      score_keys_amx(query, b.key_cache, offsets, padded, item, s, prefetch,
                     grown(w.pairs, heads * s.head_dim / 2), scores, row);
      scored = true;
    }
  }
#endif
  if (!scored) score_keys(query, b.key_cache, offsets, padded, item, s, prefetch, scores, row);
  if (scoring.softcap > 0)
    softmax_capped_rows(scores, first - begin, length - begin, padded, heads, row, scoring,
                        totals);
  else
    softmax_rows(scores, first - begin, length - begin, padded, heads, row, scoring.scale,
                 totals);

  const int64_t budget = kTile / (item.kv_end - item.kv_begin) + 2;
  for (int64_t t = 0; t < padded; t += kTile) {  // positions [t, t + 16)
    for (int64_t h = item.kv_begin; h < item.kv_end; ++h) {
      const int64_t i = (h - item.kv_begin) * s.group;  // the kv head's first query head
      prefetch.advance(padded + t + kTile + kPrefetchRows, budget);
      value_tile_heads(b.value_cache + h * s.head_dim, offsets + t, s.head_dim, s.group,
                       scores + t * row + i, row, acc + i * acc_stride, acc_stride);
    }
  }
  for (int64_t i = 0; i < heads; ++i)
    store_output(acc + i * acc_stride, 1.0f / totals[i], s.head_dim, out + i * s.head_dim);
}

// The work items, longest first (by the keys they read: a window caps that): the last items
// to finish are then short ones. A whole request per item when that still gives every thread
// several items (contiguous reads, see the top); otherwise one kv head per item, so that few
// requests still spread.
std::vector<Item> work_items(const int64_t* context_lens, int64_t num_decodes,
                             int64_t num_kv_heads, int64_t window) {
  const int64_t splits = num_decodes >= 4 * omp_get_max_threads() ? 1 : num_kv_heads;
  std::vector<Item> items;
  items.reserve(num_decodes * splits);
  for (int64_t d = 0; d < num_decodes; ++d)
    for (int64_t part = 0; part < splits; ++part)
      items.push_back({d, part * num_kv_heads / splits, (part + 1) * num_kv_heads / splits});
  auto keys_read = [&](const Item& item) {
    return window > 0 ? std::min(context_lens[item.d], window) : context_lens[item.d];
  };
  std::stable_sort(items.begin(), items.end(),
                   [&](const Item& a, const Item& b) { return keys_read(a) > keys_read(b); });
  return items;
}

}  // namespace

template <typename T>
void paged_decode_attention(const T* query, int64_t query_stride, const T* key_cache,
                            const T* value_cache, const int64_t* block_tables,
                            int64_t max_blocks, const int64_t* context_lens, T* out,
                            int64_t num_decodes, int64_t num_heads, int64_t num_kv_heads,
                            int64_t head_dim, int64_t block_size, float scale,
                            int64_t sliding_window, float softcap) {
  const Shape s{num_heads,  num_kv_heads, head_dim, block_size, num_heads / num_kv_heads,
                num_kv_heads * head_dim};
  const Batch<T> batch{query,      query_stride, key_cache, value_cache,
                       block_tables, max_blocks, context_lens, out};
  const Scoring scoring{scale, softcap, sliding_window};
  const std::vector<Item> items =
      work_items(context_lens, num_decodes, num_kv_heads, sliding_window);
  const int64_t count = static_cast<int64_t>(items.size());
#pragma omp parallel for schedule(dynamic) if (count > 1)
  for (int64_t index = 0; index < count; ++index) attend(batch, items[index], s, scoring);
}

#define METERSERVE_INSTANTIATE(T)                                                              \
  template void paged_decode_attention<T>(const T*, int64_t, const T*, const T*, const int64_t*, \
                                          int64_t, const int64_t*, T*, int64_t, int64_t,       \
                                          int64_t, int64_t, int64_t, float, int64_t, float);

METERSERVE_INSTANTIATE(float)
METERSERVE_INSTANTIATE(bf16)

}  // namespace meterserve
