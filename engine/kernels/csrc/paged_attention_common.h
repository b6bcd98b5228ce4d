// Shared by paged_attention.cpp and its score kernels: constants, the call's shape and work
// items, per-thread scratch, slot offsets and the software prefetcher; with
// prefill_attention.cpp: how scores become weights (Scoring, softcapped).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "numeric.h"
#include "vec.h"

namespace meterserve {
namespace attention {

constexpr int kTile = 16;              // positions per tile: one score per vector lane
constexpr int kLine = 64;              // cache line bytes
constexpr int64_t kPrefetchRows = 16;  // how far past the current tile rows are prefetched
constexpr int kMaxHeadTile = 4;        // query heads whose accumulators share a pass over values

struct Shape {
  int64_t num_heads, num_kv_heads, head_dim, block_size, group, slot_stride;
};

// How a query's scores become weights: x = scale * (query . key); with softcap c > 0,
// x = c * tanh(x / c) (Gemma 2's logit softcapping); with window W > 0, the query at position p
// sees keys j in (p - W, p] only (transformers' sliding-window mask), else all j <= p. Keys
// outside are skipped, never weighted by zero: their blocks may have been freed and reused.
struct Scoring {
  float scale;
  float softcap;   // 0: none
  int64_t window;  // 0: none
};

// The first key position the query at `position` sees.
inline int64_t first_visible(int64_t position, int64_t window) {
  return window > 0 ? std::max<int64_t>(position - window + 1, 0) : 0;
}

// c * tanh(x / c) per lane, c > 0, with tanh(y) = 1 - 2 / (e^(2y) + 1): exact at the
// saturated ends (exp clamps, so no inf / inf), ~1e-7 absolute error near 0.
inline __m512 softcapped(__m512 x, float cap) {
  const __m512 e = exp(_mm512_mul_ps(x, _mm512_set1_ps(2.0f / cap)));
  const __m512 t = _mm512_sub_ps(_mm512_set1_ps(1.0f),
                                 _mm512_div_ps(_mm512_set1_ps(2.0f),
                                               _mm512_add_ps(e, _mm512_set1_ps(1.0f))));
  return _mm512_mul_ps(t, _mm512_set1_ps(cap));
}

// Work item: request d's kv heads [kv_begin, kv_end), with the query heads that read them.
struct Item {
  int64_t d, kv_begin, kv_end;
};

// The call's arguments, as paged_decode_attention takes them.
template <typename T>
struct Batch {
  const T* query;
  int64_t query_stride;
  const T* key_cache;
  const T* value_cache;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* context_lens;
  T* out;
};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

inline __mmask32 lanes32(int64_t count) {
  return count >= 32 ? ~__mmask32(0) : (__mmask32(1) << count) - 1;
}

// Per-thread scratch, grown on demand and reused by every later item and call.
struct Scratch {
  std::vector<int64_t> offsets;  // [padded]: element offset of each position's slot row
  std::vector<float> scores;     // [padded][row]: scores, then exp(scale * (score - max))
  std::vector<float> acc;        // [heads][acc_stride]: unnormalized outputs
  std::vector<float> totals;     // [heads]: softmax denominators
  std::vector<uint32_t> pairs;   // AMX: the item's queries as bf16 pairs (amx::query_pairs)
};

inline Scratch& scratch() {
  thread_local Scratch s;
  return s;
}

template <typename V>
V* grown(std::vector<V>& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(size);
  return buffer.data();
}

// An item reads positions [begin, begin + padded) of which [first, length) are visible:
//   offsets[u] = where position begin + u's slot row starts, in elements, for begin + u in
//   [from, length), from = max(begin, the start of first's block): rows of first's block
//   before it are read as they are (an AMX tile loads 16 rows of one block from its first).
//   Every other u (before from: rows of blocks wholly outside the window, which may have been
//   freed; from length on: a tail tile) gets position first's row, so that every read is of
//   valid memory. The scores of lanes outside [first, length) are dropped, their
//   probabilities are zero (first = begin = 0 without a window).
inline void slot_offsets(const int64_t* table, int64_t begin, int64_t first, int64_t length,
                         int64_t padded, const Shape& s, int64_t* offsets) {
  const int64_t from = std::max(begin, first / s.block_size * s.block_size);
  const int64_t fill = (table[first / s.block_size] * s.block_size + first % s.block_size) *
                       s.slot_stride;
  int64_t u = 0;
  for (; begin + u < from; ++u) offsets[u] = fill;
  for (int64_t b = from / s.block_size, i = from % s.block_size; begin + u < length; ++b, i = 0)
    for (; i < s.block_size && begin + u < length; ++i, ++u)
      offsets[u] = (table[b] * s.block_size + i) * s.slot_stride;
  for (; u < padded; ++u) offsets[u] = fill;
}

// Software prefetch running ahead of an item's reads, over a "stream" of rows: the keys of
// positions [0, padded), then their values ([padded, 2 padded)). A few rows at a time between
// pieces of arithmetic rather than a tile's ~100 lines at once: a burst queues on the core's
// ~16 line-fill buffers and holds up the arithmetic behind it, a trickle overlaps with it
// (measured on a synthetic stream: a burst per tile no faster than no prefetch at all, the
// trickle close to the bare streaming time). Blocks are scattered, so the hardware
// prefetchers alone lose the stream at every block; no prefetch here measured ~1.5x slower.
template <typename T>
class Prefetcher {
 public:
  // keys / values: the item's first row element in each cache; rows of row_bytes each.
  Prefetcher(const T* keys, const T* values, const int64_t* offsets, int64_t padded,
             int64_t row_bytes)
      : keys_(keys), values_(values), offsets_(offsets), padded_(padded), row_bytes_(row_bytes) {}

  // Prefetch up to `budget` rows of the stream positions before `until`.
  void advance(int64_t until, int64_t budget) {
    for (until = std::min(until, 2 * padded_); budget > 0 && next_ < until; --budget, ++next_) {
      const T* row =
          next_ < padded_ ? keys_ + offsets_[next_] : values_ + offsets_[next_ - padded_];
      const char* begin = reinterpret_cast<const char*>(row);
      // lines [begin rounded down to a line, begin + row_bytes_)
      const char* line = begin - (reinterpret_cast<uintptr_t>(begin) & (kLine - 1));
      for (; line < begin + row_bytes_; line += kLine) _mm_prefetch(line, _MM_HINT_T0);
    }
  }

 private:
  const T* keys_;
  const T* values_;
  const int64_t* offsets_;
  int64_t padded_, row_bytes_;
  int64_t next_ = 0;  // next stream position to prefetch
};


}  // namespace attention
}  // namespace meterserve
