// Causal prefill attention over the paged cache: flash attention on AVX512-BF16.
//
// Chunk c's query rows [query_start, query_start + query_len) sit at positions
// [start, start + query_len) of their request; query position p attends to key positions
// [0, p] (the prefix already in the cache and the chunk's own keys, which store_kv wrote
// before this call). Query head q reads kv head q / group, as in HF's GQA. Under a sliding
// window W > 0 it sees only (p - W, p], and a softcap c > 0 caps the scaled scores to
// c * tanh(score / c) before the softmax (Scoring in paged_attention_common.h).
//
// Why it is shaped this way: at 2,048 tokens attention is most of a prefill (torch's CPU
// flash attention took 34 ms a layer of SmolLM2's 47 on an AVX512-BF16 machine without AMX,
// ~0.14 TFLOP/s), and most of that is not the products but the softmax between them.
//  - Two phases in one parallel region. First every (chunk, kv head) has its keys and values
//    repacked once into the operand layouts of _mm512_dpbf16_ps: keys as 16-position tiles of
//    (dim 2c, dim 2c+1) pairs, values as (position 2j, position 2j+1) pairs per dim. Then
//    work items of a few query rows each stream those packed blocks from L2.
//  - A pass takes R query rows (R query heads x positions of one kv head: GQA's heads share
//    every key and value load) through the keys 32 at a time: R x 32 scores from D/2 pair
//    products, the online softmax in fp32 (a running max per row; its sum kept per lane and
//    reduced once at the end; the accumulators rescaled only by a block that raises the max,
//    rare after the first few), the probabilities rounded to bf16 pairs and multiplied into
//    R x D fp32 accumulators that stay in registers for the whole pass. (The two deferrals
//    took one 2,048-token SmolLM2 layer from 11.0 to 8.9-9.9 ms on a 2-core EPYC.)
//  - Probabilities are rounded to bf16 before the value product, as torch's flash attention
//    does for bf16; their sum is kept in fp32 before rounding.
//  - Only key blocks a pass's rows can see are read: up to its last row's diagonal block
//    (masked), from its first row's window on (the window's edge block masked). A chunk's keys
//    before its first query's window are neither packed nor read (their cache blocks may have
//    been freed): a small window over a long prefix costs only the window.
//  - Items go longest first under a dynamic schedule: causal rows differ in length.
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <memory>
#include <new>
#include <vector>

#include "kernels.h"
#include "paged_attention_common.h"
#include "vec.h"

namespace meterserve {
namespace {

using attention::first_visible;
using attention::Scoring;
using attention::softcapped;

constexpr int kKeyBlock = 32;   // keys per softmax step: two score vectors per row
constexpr int kPassRows = 32;   // query rows per work item (several passes)

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, slot_stride, query_stride;
};

// Key blocks [first_block, ceil(context / 32)) are packed, from the one holding first_key,
// the first key the chunk's first query sees (0 without a window).
struct ChunkView {
  int64_t query_start, query_len, start, out_row, context, packed;  // packed: u32 offset
  const int64_t* table;
  int64_t first_key, first_block;
};

struct Item {
  int64_t chunk, kv_head, row_begin, row_end;  // rows r = query index * group + head in group
};

inline int64_t round_up(int64_t x, int64_t to) { return (x + to - 1) / to * to; }

inline int64_t num_key_blocks(const ChunkView& c) {
  return round_up(c.context, kKeyBlock) / kKeyBlock - c.first_block;
}

// Key and value blocks of one (chunk, kv head), each num_key_blocks * 32 * head_dim / 2 words.
inline int64_t packed_words(const ChunkView& c, const Geometry& g) {
  return num_key_blocks(c) * kKeyBlock * g.head_dim / 2;
}

// rows[r] lane c -> rows[c] lane r: a 16 x 16 transpose of 32-bit elements (16 unpacks of
// 32-bit, 16 of 64-bit within 128-bit lanes, then 16 + 16 lane shuffles).
inline void transpose16(__m512i (&m)[16]) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(m[i], m[i + 1]);      // lane: r_i[0] r_i+1[0] r_i[1] r_i+1[1]
    t[i + 1] = _mm512_unpackhi_epi32(m[i], m[i + 1]);  // lane: r_i[2] r_i+1[2] r_i[3] r_i+1[3]
  }
  for (int i = 0; i < 16; i += 4) {  // u[i + k], lane L: column 4L + k of rows i .. i + 3
    u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int k = 0; k < 4; ++k) {  // column 4L + k: lane L of u[k], u[4 + k], u[8 + k], u[12 + k]
    const __m512i v0 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0x44);
    const __m512i v1 = _mm512_shuffle_i32x4(u[k], u[4 + k], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0x44);
    const __m512i v3 = _mm512_shuffle_i32x4(u[8 + k], u[12 + k], 0xEE);
    m[k] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    m[4 + k] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    m[8 + k] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    m[12 + k] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

inline __m512i load_or_zero(const void* p) {
  return p != nullptr ? _mm512_loadu_si512(p) : _mm512_setzero_si512();
}

// Repack key block kb (positions [32 kb, 32 kb + 32)) of kv head h: keys into tiles
// kp[tile][pair c][lane] = (k[2c], k[2c + 1]) of position 16 tile + lane, values into
// vp[j][d] = (v_{2j}[d], v_{2j+1}[d]) (kp, vp: the chunk's packed block first_block);
// positions before first_key or past the context are zeros, not read. Vectorized: a
// tile's keys are 16 x 16 transposes of 32-bit pairs, a position pair's values two-row word
// interleaves (scalar, packing was most of a step of short chunks over long cached prefixes).
void pack_block(const bf16* key_cache, const bf16* value_cache, const ChunkView& c, int64_t h,
                int64_t kb, const Geometry& g, uint32_t* kp, uint32_t* vp) {
  const int64_t pairs = g.head_dim / 2;
  uint32_t* keys = kp + (kb - c.first_block) * kKeyBlock * pairs;
  uint16_t* values = reinterpret_cast<uint16_t*>(vp + (kb - c.first_block) * kKeyBlock * pairs);
  const uint32_t* key_rows[kKeyBlock];
  const uint16_t* value_rows[kKeyBlock];
  for (int64_t i = 0; i < kKeyBlock; ++i) {
    const int64_t t = kb * kKeyBlock + i;
    if (t < c.first_key || t >= c.context) {
      key_rows[i] = nullptr, value_rows[i] = nullptr;
      continue;
    }
    const int64_t slot = c.table[t / g.block_size] * g.block_size + t % g.block_size;
    const int64_t offset = slot * g.slot_stride + h * g.head_dim;
    key_rows[i] = reinterpret_cast<const uint32_t*>(key_cache + offset);
    value_rows[i] = reinterpret_cast<const uint16_t*>(value_cache + offset);
  }
  for (int64_t tile = 0; tile < kKeyBlock / 16; ++tile) {
    uint32_t* tile_keys = keys + tile * pairs * 16;
    for (int64_t p0 = 0; p0 < pairs; p0 += 16) {
      __m512i m[16];
      for (int i = 0; i < 16; ++i) {
        const uint32_t* row = key_rows[tile * 16 + i];
        m[i] = load_or_zero(row != nullptr ? row + p0 : nullptr);
      }
      transpose16(m);
      for (int col = 0; col < 16; ++col) _mm512_storeu_si512(tile_keys + (p0 + col) * 16, m[col]);
    }
  }
  // Word k of an interleave: even k from the first row, odd from the second, dims d0 + k / 2.
  alignas(64) static const uint16_t kLow[32] = {0,  32, 1,  33, 2,  34, 3,  35, 4,  36, 5,
                                                37, 6,  38, 7,  39, 8,  40, 9,  41, 10, 42,
                                                11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  const __m512i low = _mm512_load_si512(kLow);
  const __m512i high = _mm512_add_epi16(low, _mm512_set1_epi16(16));
  for (int64_t j = 0; j < kKeyBlock / 2; ++j) {
    const uint16_t* a = value_rows[2 * j];
    const uint16_t* b = value_rows[2 * j + 1];
    uint16_t* out = values + j * g.head_dim * 2;
    for (int64_t d0 = 0; d0 < g.head_dim; d0 += 32) {
      const __m512i va = load_or_zero(a != nullptr ? a + d0 : nullptr);
      const __m512i vb = load_or_zero(b != nullptr ? b + d0 : nullptr);
      _mm512_storeu_si512(out + d0 * 2, _mm512_permutex2var_epi16(va, low, vb));
      _mm512_storeu_si512(out + d0 * 2 + 32, _mm512_permutex2var_epi16(va, high, vb));
    }
  }
}

inline __m512bh broadcast_pair(uint32_t pair) {
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// Lanes of a 16-key score vector whose keys (first at key0) a row at `position` may see.
inline __mmask16 visible(int64_t key0, int64_t position) {
  return lanes(std::max<int64_t>(position - key0 + 1, 0));
}

// Lanes of a 16-key score vector whose keys (first at key0) are at or after `first`.
inline __mmask16 from_key(int64_t key0, int64_t first) {
  return static_cast<__mmask16>(~lanes(std::max<int64_t>(first - key0, 0)));
}

// One pass: R query rows through key blocks [kb_begin, kb_end), kp / vp pointing at block
// kb_begin's packed keys and values. queries[r] points at row r's bf16 query (as pairs),
// positions[r] is its position, out[r] its output (nullptr: a padding row, computed and
// dropped).
template <int D, int R>
void attend_pass(const uint32_t* const (&queries)[R], const int64_t (&positions)[R],
                 int64_t kb_begin, int64_t kb_end, const uint32_t* kp, const uint32_t* vp,
                 const Scoring& scoring, bf16* const (&out)[R]) {
  constexpr int kPairs = D / 2, kOut = D / 16;
  __m512 acc[R][kOut];
  float row_max[R];
  alignas(64) float row_sums[R][16];  // per lane; reduced once at the end
  for (int r = 0; r < R; ++r) {
    for (int v = 0; v < kOut; ++v) acc[r][v] = _mm512_setzero_ps();
    row_max[r] = -std::numeric_limits<float>::infinity();
    _mm512_store_ps(row_sums[r], _mm512_setzero_ps());
  }
  int64_t lowest = positions[0], highest = positions[0];
  for (int r = 1; r < R; ++r) {
    lowest = std::min(lowest, positions[r]);
    highest = std::max(highest, positions[r]);
  }
  const float scale = scoring.scale;
  alignas(64) uint32_t probs[R][16];
  for (int64_t kb = kb_begin; kb < kb_end; ++kb) {
    const uint32_t* tile0 = kp + (kb - kb_begin) * kKeyBlock * kPairs;
    const uint32_t* tile1 = tile0 + 16 * kPairs;
    __m512 score[R][2];
    for (int r = 0; r < R; ++r) score[r][0] = score[r][1] = _mm512_setzero_ps();
#pragma GCC unroll 8
    for (int c = 0; c < kPairs; ++c) {
      const __m512bh k0 = (__m512bh)_mm512_load_si512(tile0 + c * 16);
      const __m512bh k1 = (__m512bh)_mm512_load_si512(tile1 + c * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh q = broadcast_pair(queries[r][c]);
        score[r][0] = _mm512_dpbf16_ps(score[r][0], q, k0);
        score[r][1] = _mm512_dpbf16_ps(score[r][1], q, k1);
      }
    }
    const int64_t key0 = kb * kKeyBlock;
    const bool diagonal = key0 + kKeyBlock - 1 > lowest;
    // The block starts before some row's window: its keys there are masked out.
    const bool edge = key0 < first_visible(highest, scoring.window);
    const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int r = 0; r < R; ++r) {
      __mmask16 m0 = 0xFFFF, m1 = 0xFFFF;
      if (diagonal) m0 = visible(key0, positions[r]), m1 = visible(key0 + 16, positions[r]);
      if (edge) {
        const int64_t first = first_visible(positions[r], scoring.window);
        m0 &= from_key(key0, first), m1 &= from_key(key0 + 16, first);
      }
      __m512 x0, x1;
      if (scoring.softcap > 0) {
        const __m512 s0 = _mm512_mul_ps(score[r][0], _mm512_set1_ps(scale));
        const __m512 s1 = _mm512_mul_ps(score[r][1], _mm512_set1_ps(scale));
        x0 = _mm512_mask_mov_ps(minus_inf, m0, softcapped(s0, scoring.softcap));
        x1 = _mm512_mask_mov_ps(minus_inf, m1, softcapped(s1, scoring.softcap));
      } else {
        x0 = _mm512_mask_mul_ps(minus_inf, m0, score[r][0], _mm512_set1_ps(scale));
        x1 = _mm512_mask_mul_ps(minus_inf, m1, score[r][1], _mm512_set1_ps(scale));
      }
      const float block_max = _mm512_reduce_max_ps(_mm512_max_ps(x0, x1));
      // A block that does not raise the row's max (most, past the first few) needs no
      // rescale; a row that sees none of the block (-inf max) keeps its state.
      if (block_max > row_max[r]) {
        const __m512 alpha = _mm512_set1_ps(std::exp(row_max[r] - block_max));  // 0 at first
        _mm512_store_ps(row_sums[r], _mm512_mul_ps(_mm512_load_ps(row_sums[r]), alpha));
        for (int v = 0; v < kOut; ++v) acc[r][v] = _mm512_mul_ps(acc[r][v], alpha);
        row_max[r] = block_max;
      }
      const __m512 top = _mm512_set1_ps(row_max[r]);
      const __m512 e0 = _mm512_maskz_mov_ps(m0, exp(_mm512_sub_ps(x0, top)));
      const __m512 e1 = _mm512_maskz_mov_ps(m1, exp(_mm512_sub_ps(x1, top)));
      _mm512_store_ps(row_sums[r],
                      _mm512_add_ps(_mm512_load_ps(row_sums[r]), _mm512_add_ps(e0, e1)));
      _mm512_store_si512(probs[r], (__m512i)_mm512_cvtne2ps_pbh(e1, e0));
    }
    const uint32_t* values = vp + (kb - kb_begin) * kKeyBlock * kPairs;
    for (int j = 0; j < 16; ++j) {  // positions 2j, 2j + 1 of the block
      __m512bh v_pairs[kOut];
      for (int v = 0; v < kOut; ++v)
        v_pairs[v] = (__m512bh)_mm512_load_si512(values + j * D + v * 16);
      for (int r = 0; r < R; ++r) {
        const __m512bh p = broadcast_pair(probs[r][j]);
        for (int v = 0; v < kOut; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], p, v_pairs[v]);
      }
    }
  }
  for (int r = 0; r < R; ++r) {
    if (out[r] == nullptr) continue;
    const __m512 inverse = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(_mm512_load_ps(row_sums[r])));
    for (int v = 0; v < kOut; ++v) store(out[r] + v * 16, _mm512_mul_ps(acc[r][v], inverse));
  }
}

// Rows [item.row_begin, item.row_end) of one (chunk, kv head), R at a time; a short last pass
// repeats its last row. kp / vp: the chunk's packed block first_block.
template <int D, int R>
void attend_item(const bf16* query, const ChunkView& c, const Item& item, const Geometry& g,
                 const uint32_t* kp, const uint32_t* vp, const Scoring& scoring, bf16* out) {
  for (int64_t r0 = item.row_begin; r0 < item.row_end; r0 += R) {
    const uint32_t* rows[R];
    int64_t positions[R];
    bf16* outs[R];
    for (int r = 0; r < R; ++r) {
      const int64_t row = std::min<int64_t>(r0 + r, item.row_end - 1);
      const int64_t index = row / g.group, head = item.kv_head * g.group + row % g.group;
      rows[r] = reinterpret_cast<const uint32_t*>(query + (c.query_start + index) * g.query_stride +
                                                  head * D);
      positions[r] = c.start + index;
      outs[r] = r0 + r < item.row_end ? out + ((c.out_row + index) * g.num_heads + head) * D
                                      : nullptr;
    }
    const int64_t last = c.start + (std::min(r0 + R, item.row_end) - 1) / g.group;
    const int64_t kb_begin = first_visible(c.start + r0 / g.group, scoring.window) / kKeyBlock;
    const int64_t skipped = (kb_begin - c.first_block) * kKeyBlock * (D / 2);
    attend_pass<D, R>(rows, positions, kb_begin, last / kKeyBlock + 1, kp + skipped,
                      vp + skipped, scoring, outs);
  }
}

std::vector<Item> work_items(const std::vector<ChunkView>& chunks, const Geometry& g,
                             int64_t window) {
  std::vector<Item> items;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci)
    for (int64_t h = 0; h < g.num_kv_heads; ++h) {
      const int64_t rows = chunks[ci].query_len * g.group;
      for (int64_t r = 0; r < rows; r += kPassRows)
        items.push_back({ci, h, r, std::min(r + kPassRows, rows)});
    }
  // Longest first: an item's work grows with the keys it reads, from its first row's window
  // (0 without one) to its last row.
  auto keys_read = [&](const Item& item) {
    const ChunkView& c = chunks[item.chunk];
    const int64_t first = first_visible(c.start + item.row_begin / g.group, window);
    return c.start + item.row_end / g.group - first;
  };
  std::sort(items.begin(), items.end(),
            [&](const Item& a, const Item& b) { return keys_read(a) > keys_read(b); });
  return items;
}

// The calling thread's packing buffer: grown on demand (contents undefined), kept between
// calls up to kRetainBytes so that a step's 30 layers reuse one allocation; a larger one
// (long contexts in many chunks) is freed after its call instead of held for good.
class PackedBuffer {
 public:
  static constexpr int64_t kRetainBytes = int64_t{256} << 20;

  __m512i* get(int64_t vectors) {
    if (vectors > capacity_) {
      data_.reset(static_cast<__m512i*>(std::aligned_alloc(64, vectors * sizeof(__m512i))));
      if (!data_) throw std::bad_alloc();
      capacity_ = vectors;
    }
    return data_.get();
  }

  void trim() {
    if (capacity_ * static_cast<int64_t>(sizeof(__m512i)) > kRetainBytes) {
      data_.reset();
      capacity_ = 0;
    }
  }

 private:
  struct Free {
    void operator()(__m512i* p) const { std::free(p); }
  };
  std::unique_ptr<__m512i, Free> data_;
  int64_t capacity_ = 0;
};

thread_local PackedBuffer packed_buffer;

template <int D, int R>
void run(const bf16* query, const bf16* key_cache, const bf16* value_cache,
         std::vector<ChunkView>& chunks, const Geometry& g, const Scoring& scoring, bf16* out) {
  int64_t words = 0;
  // (chunk, kv head * num_key_blocks + packed block), packed block = block - first_block
  std::vector<std::pair<int64_t, int64_t>> blocks;
  for (int64_t ci = 0; ci < static_cast<int64_t>(chunks.size()); ++ci) {
    chunks[ci].packed = words;
    words += 2 * g.num_kv_heads * packed_words(chunks[ci], g);
    const int64_t num_blocks = num_key_blocks(chunks[ci]);
    for (int64_t b = 0; b < g.num_kv_heads * num_blocks; ++b) blocks.emplace_back(ci, b);
  }
  // 64-byte aligned words for the aligned vector loads, kept between calls and never
  // value-initialized: pack_block writes every word (zeros past a context), and a fresh
  // zero-filled buffer per call (one per layer) cost a page fault per 4 KiB of packed keys
  // and values, most of a step whose short chunks read long cached prefixes.
  uint32_t* packed = reinterpret_cast<uint32_t*>(packed_buffer.get((words + 15) / 16));
  const std::vector<Item> items = work_items(chunks, g, scoring.window);
  auto key_base = [&](const ChunkView& c, int64_t h) {
    return packed + c.packed + 2 * h * packed_words(c, g);
  };
#pragma omp parallel
  {
#pragma omp for schedule(static)
    for (int64_t i = 0; i < static_cast<int64_t>(blocks.size()); ++i) {
      const ChunkView& c = chunks[blocks[i].first];
      const int64_t num_blocks = num_key_blocks(c);
      const int64_t h = blocks[i].second / num_blocks;
      const int64_t kb = c.first_block + blocks[i].second % num_blocks;
      uint32_t* kp = key_base(c, h);
      pack_block(key_cache, value_cache, c, h, kb, g, kp, kp + packed_words(c, g));
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < static_cast<int64_t>(items.size()); ++i) {
      const Item& item = items[i];
      const ChunkView& c = chunks[item.chunk];
      const uint32_t* kp = key_base(c, item.kv_head);
      attend_item<D, R>(query, c, item, g, kp, kp + packed_words(c, g), scoring, out);
    }
  }
  packed_buffer.trim();
}

}  // namespace

void paged_prefill_attention(const bf16* query, int64_t query_stride, const bf16* key_cache,
                             const bf16* value_cache, const int64_t* block_tables,
                             int64_t max_blocks, const int64_t* spans, int64_t num_chunks,
                             bf16* out, int64_t num_heads, int64_t num_kv_heads,
                             int64_t head_dim, int64_t block_size, float scale,
                             int64_t sliding_window, float softcap) {
  const Geometry g{num_heads,  num_kv_heads, num_heads / num_kv_heads, head_dim,
                   block_size, num_kv_heads * head_dim, query_stride};
  std::vector<ChunkView> chunks;
  int64_t out_row = 0;
  for (int64_t i = 0; i < num_chunks; ++i) {
    const int64_t* span = spans + 3 * i;  // query_start, query_len, start_position
    const int64_t first_key = first_visible(span[2], sliding_window);
    chunks.push_back({span[0], span[1], span[2], out_row, span[2] + span[1], 0,
                      block_tables + i * max_blocks, first_key, first_key / kKeyBlock});
    out_row += span[1];
  }
  const Scoring scoring{scale, softcap, sliding_window};
  if (head_dim == 64)
    run<64, 4>(query, key_cache, value_cache, chunks, g, scoring, out);
  else
    run<128, 2>(query, key_cache, value_cache, chunks, g, scoring, out);
}

}  // namespace meterserve
