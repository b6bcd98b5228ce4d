// Attention scores with AVX-512 for paged_attention.cpp: 16 positions per tile, one
// transpose-and-add tree instead of 16 horizontal reductions (see paged_attention.cpp's notes).
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "numeric.h"
#include "paged_attention_common.h"
#include "vec.h"

namespace meterserve {
namespace attention {

// Partial sums of position t go to part[lane_slot(t)]: sum_lanes then leaves position t's
// total in lane t (its tree swaps lane-index bits 0 <-> 1 and 2 <-> 3; see there).
constexpr int lane_slot(int t) { return ((t & 5) << 1) | ((t >> 1) & 5); }

// Lane i of the result = horizontal sum of part[lane_slot(i)]. Four levels, each halving the
// vector count and the lanes per vector: 30 shuffles and 15 adds for 16 reductions.
inline __m512 sum_lanes(const __m512 (&part)[kTile]) {
  __m512 half[8];  // lanes [0, 8) sum part[i]'s 256-bit halves, lanes [8, 16) part[i + 8]'s
  for (int i = 0; i < 8; ++i)
    half[i] = _mm512_add_ps(_mm512_shuffle_f32x4(part[i], part[i + 8], 0x44),
                            _mm512_shuffle_f32x4(part[i], part[i + 8], 0xEE));
  __m512 quarter[4];  // 128-bit quarters hold part[i], [i + 8], [i + 4], [i + 12]
  for (int i = 0; i < 4; ++i)
    quarter[i] = _mm512_add_ps(_mm512_shuffle_f32x4(half[i], half[i + 4], 0x88),
                               _mm512_shuffle_f32x4(half[i], half[i + 4], 0xDD));
  __m512 pair[2];  // per quarter: lanes 0-1 from quarter[i], lanes 2-3 from quarter[i + 2]
  for (int i = 0; i < 2; ++i)
    pair[i] =
        _mm512_add_ps(_mm512_shuffle_ps(quarter[i], quarter[i + 2], _MM_SHUFFLE(1, 0, 1, 0)),
                      _mm512_shuffle_ps(quarter[i], quarter[i + 2], _MM_SHUFFLE(3, 2, 3, 2)));
  // per quarter: quarter[0], quarter[2], quarter[1], quarter[3]: lane bits 0 and 1 swapped
  return _mm512_add_ps(_mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_ps(pair[0], pair[1], _MM_SHUFFLE(3, 1, 3, 1)));
}

// query . key as 16 lanes of partial sums: fp32 FMAs, or for bf16 _mm512_dpbf16_ps over
// (even, odd) pairs, 32 dims a step, the last step masked when head_dim % 32 == 16.
// kDim: head_dim when known at compile time (unrolled, query kept in registers), else 0.
template <int kDim>
inline __m512 partial_dot(const float* query, const float* key, int64_t head_dim) {
  const int64_t dim = kDim ? kDim : head_dim;
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(query), _mm512_loadu_ps(key));
  for (int64_t c = kVecLanes; c < dim; c += kVecLanes)  // dims [c, c + 16)
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(query + c), _mm512_loadu_ps(key + c), acc);
  return acc;
}

inline __m512bh bf16_pairs(const bf16* p, __mmask32 mask) {
  return (__m512bh)_mm512_maskz_loadu_epi16(mask, p);
}

template <int kDim>
inline __m512 partial_dot(const bf16* query, const bf16* key, int64_t head_dim) {
  const int64_t dim = kDim ? kDim : head_dim;
  __m512 acc = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 32 <= dim; c += 32)  // dims [c, c + 32)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_loadu_si512(query + c),
                           (__m512bh)_mm512_loadu_si512(key + c));
  if (c < dim)  // dims [c, c + 16)
    acc = _mm512_dpbf16_ps(acc, bf16_pairs(query + c, 0xFFFF), bf16_pairs(key + c, 0xFFFF));
  return acc;
}

// scores[t * score_stride] = query . key(t) for the tile's 16 positions; `keys` points at the
// kv head's first element in the cache, offsets[t] at position t's slot row.
template <typename T, int kDim>
inline void score_tile(const T* query, const T* keys, const int64_t* offsets, int64_t head_dim,
                float* scores, int64_t score_stride) {
  __m512 part[kTile];
#pragma GCC unroll 16
  for (int t = 0; t < kTile; ++t)
    part[lane_slot(t)] = partial_dot<kDim>(query, keys + offsets[t], head_dim);
  const __m512i rows = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
      _mm512_set1_epi32(static_cast<int>(score_stride)));
  _mm512_i32scatter_ps(scores, rows, sum_lanes(part), sizeof(float));
}

template <typename T>
using ScoreTile = void (*)(const T*, const T*, const int64_t*, int64_t, float*, int64_t);

// The common head sizes get their own unrolled copy.
template <typename T>
ScoreTile<T> score_tile_for(int64_t head_dim) {
  switch (head_dim) {
    case 64: return score_tile<T, 64>;
    case 128: return score_tile<T, 128>;
    default: return score_tile<T, 0>;
  }
}

// scores[t * row + i] = query head i . key(t) for the item's query heads i and positions
// t in [0, padded), one score_tile per (tile, query head).
template <typename T>
inline void score_keys(const T* query, const T* key_cache, const int64_t* offsets, int64_t padded,
                const Item& item, const Shape& s, Prefetcher<T>& prefetch, float* scores,
                int64_t row) {
  const ScoreTile<T> tile_scores = score_tile_for<T>(s.head_dim);
  const int64_t heads = (item.kv_end - item.kv_begin) * s.group;
  const int64_t budget = kTile / heads + 2;  // a tile's rows over its pieces, plus catch-up
  for (int64_t t = 0; t < padded; t += kTile) {  // positions [t, t + 16)
    for (int64_t i = 0; i < heads; ++i) {
      const int64_t head = item.kv_begin * s.group + i;
      prefetch.advance(t + kTile + kPrefetchRows, budget);
      tile_scores(query + head * s.head_dim, key_cache + head / s.group * s.head_dim,
                  offsets + t, s.head_dim, scores + t * row + i, row);
    }
  }
}


}  // namespace attention
}  // namespace meterserve
