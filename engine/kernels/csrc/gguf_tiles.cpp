// Products over GGUF blocks for a few rows (2-64) on AMX tiles: speculative verification
// passes and decode batches of up to 64 requests.
//
// The vector kernel (gguf_linear.cpp) costs one dot product per row and sub-block, so above a
// row or two it is bound by arithmetic, not by the blocks it streams (measured on the embedded
// model's 3072 x 576 Q4_1 layer, 2 threads: 66 us at 1 row, 197 at 5, 283 at 8). Here each
// sub-block is dequantized once (to bf16, gguf::bf16_weights: the numbers the 5-8-row vector
// path and the panels multiply) into a 16 x 32 staging tile, and one tile product multiplies
// it into all rows: the arithmetic per row nearly vanishes, and the cost is the dequantization.
//
//   A = 16 weight rows x 32 k (the staging tile: each row's sub-block kt as decoded)
//   B = x's k [32 kt, 32 kt + 32) x 16 rows, in bf16 pairs (packed once per call); a second
//       B tile holds x rows 16-31 when there are more than 16
//   C[n][m] += A . B over kt in order, so C holds out transposed (written back at the end).
// Two A tiles (32 weight rows) by up to two B tiles (32 x rows) need four C tiles: all eight.
// 17-32 rows cost 1.2-1.3x 16 (the embedded model's Q4_1 shapes, 30 layers, 2-core AMX Xeon:
// 7.9 ms at 16 rows, 9.4 at 24, 10.3 at 32), about what the bf16 copy's tiles take there
// (9.5-10.3 ms; 1.5B-shaped Q4_K: 7.5-8.2 ms against 8.3-8.7); what 17-32 rows gain is the
// decode stack, which takes up to 32 rows (decode_stack.h).
// 33-64 rows: one A tile (16 weight rows) by three or four B tiles (wide_item), each sub-block
// still dequantized once for all rows; 30 layers at 64 rows 13.8 ms, level with the bf16 copy
// in a served 64-row decode step (where the copy's 4x bytes come from memory).
// The decoding runs on the vector units while the tile unit multiplies: the next sub-blocks
// are decoded in pieces between the current ones' tile products (over_staged_sub_blocks), and
// Q4_K's sub-blocks two at a time (gguf::bf16_weight_pair). 1.5B-shaped Q4_K, 12 layers from
// memory, 2-core AMX Xeon: 32 rows 47.3-48.5 ms -> 40.9-44.1, 64 rows 1.10-1.12x, 9 rows
// 1.04-1.08x; Q6_K and Q4_1 unchanged within noise (their decoding, not the overlap, bounds
// them).
// Per row the sums are those of the AMX panels (gguf_panel.cpp), which also accumulate
// tdpbf16ps over k tiles in order: a row's result does not depend on the other rows.
#include <immintrin.h>

#include <algorithm>
#include <stdexcept>
#include <vector>

#include "amx.h"
#include "gguf_blocks.h"
#include "gguf_linear.h"
#include "vec.h"

namespace meterserve {
namespace {

#ifdef __AMX_BF16__

constexpr int64_t kRows = 16;            // weight rows per A tile, x rows per B tile
constexpr int64_t kGroupRows = 2 * kRows;  // weight rows per work item: two A tiles share B
constexpr int64_t kPairs = 16;           // bf16 pairs per tile row (32 k)
constexpr int64_t kTileWords = kPairs * kRows;  // one B tile

// B tiles per k tile for M x rows: tile h holds rows 16 h to 16 h + 15.
inline int64_t x_halves(int64_t M) { return (M + kRows - 1) / kRows; }

// Words from one k tile's B tiles to the next: the tiles plus one cache line, so that k tiles
// do not lie 4 KiB apart. At four B tiles (4 KiB) they did, and one of each k tile's tile loads
// then shared its address's low 12 bits with the staging stores just issued, which the CPU
// treats as a possible store-to-load dependency (measured 1.4x the time of three B tiles).
inline int64_t x_kt_words(int64_t halves) { return halves * kTileWords + 16; }

// x [M, K] as B tiles, x rows 16 h to 16 h + 15 in half h: tile (kt, h), row r, column c =
// (x[16 h + c][32 kt + 2 r], x[..][.. + 1]), tile (kt, h) at kt * x_kt_words + h * kTileWords;
// columns past M zero. Sixteen rows' 16 pairs of one k tile, transposed in registers, are one
// tile (it wrote 4 bytes at a time into a fresh zeroed vector before). The buffer is the calling
// thread's and only grows.
const uint32_t* pack_rows(const bf16* x, int64_t M, int64_t K, int64_t halves) {
  thread_local std::vector<uint32_t> tiles;
  if (tiles.size() < static_cast<size_t>(K / 32 * x_kt_words(halves)))
    tiles.resize(K / 32 * x_kt_words(halves));
  for (int64_t kt = 0; kt < K / 32; ++kt)
    for (int64_t h = 0; h < halves; ++h) {
      __m512 pairs[16];
      for (int64_t c = 0; c < kRows; ++c)
        pairs[c] = 16 * h + c < M ? _mm512_loadu_ps(x + (16 * h + c) * K + kt * 32)
                                  : _mm512_setzero_ps();
      transpose_16x16(pairs);
      uint32_t* words = tiles.data() + kt * x_kt_words(halves) + h * kTileWords;
      float* tile = reinterpret_cast<float*>(words);
      for (int64_t r = 0; r < kPairs; ++r) _mm512_storeu_ps(tile + r * kRows, pairs[r]);
    }
  return tiles.data();
}

// Sub-blocks staged at a time: two where a pair decodes cheaper than two alone
// (gguf::bf16_weight_pair), else one.
template <class F>
constexpr int64_t kStaged = gguf::kNibblePairs<F> ? 2 : 1;

constexpr int64_t kStageWords = kGroupRows * 32;  // one staged sub-block: 32 rows x 32 k

// A thread's scratch: the item's scales and mins per row, the staging tiles (two buffers of
// up to two sub-blocks each), C read back (block[i * 32 + m]: weight row i, x row m,
// write_transposed's layout).
struct Scratch {
  std::vector<float> scale, min;  // [kGroupRows][groups]
  alignas(64) bf16 stage[2][2 * kStageWords];
  alignas(64) float block[kGroupRows * kGroupRows];
  explicit Scratch(int64_t groups) : scale(kGroupRows * groups), min(kGroupRows * groups) {}
};

// C read back transposed (weight rows as tile rows) put into out ([.., N] bf16):
// out[m0 + j, n0 + i] = block[i * stride + j] (+ bias[n0 + i]) for j < rows, i < cols, stride a
// multiple of 16 (32 or 64). Each 16 x 16 quarter is transposed in registers and stored as
// 16-column row pieces. (It gathered one column of the block per output row before: 64 gathers
// a block, which cost as much as the block's tile products.)
void write_transposed(const float* block, int64_t stride, const bf16* bias, bf16* out,
                      int64_t N, int64_t m0, int64_t rows, int64_t n0, int64_t cols) {
  for (int64_t ih = 0; ih * kVecLanes < cols; ++ih) {  // block rows = output columns
    const int64_t count = std::min<int64_t>(kVecLanes, cols - ih * kVecLanes);
    const int64_t n = n0 + ih * kVecLanes;
    const __m512 b = bias ? load(bias + n, count) : _mm512_setzero_ps();
    for (int64_t jh = 0; jh * kVecLanes < rows; ++jh) {  // block columns = output rows
      __m512 r[16];
      for (int i = 0; i < 16; ++i)
        r[i] = _mm512_load_ps(block + (ih * kVecLanes + i) * stride + jh * kVecLanes);
      transpose_16x16(r);
      const int64_t out_rows = std::min<int64_t>(kVecLanes, rows - jh * kVecLanes);
      bf16* dst = out + (m0 + jh * kVecLanes) * N + n;
      for (int64_t j = 0; j < out_rows; ++j) store(dst + j * N, _mm512_add_ps(r[j], b), count);
    }
  }
}

// Sub-blocks kt to kt + kStaged - 1 of the item's rows [i0, i1), as bf16, into staging tiles
// (sub-block kt + j at stage + j * kStageWords).
template <class F>
inline void stage_sub_blocks(const GgufWeight& w, int64_t n0, int64_t i0, int64_t i1,
                             int64_t kt, const Scratch& s, bf16* stage) {
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes, groups = w.K / F::kGroup;
  for (int64_t i = i0; i < i1; ++i) {
    const uint8_t* row = w.blocks + (n0 + i) * row_bytes;
    const float *scale = &s.scale[i * groups], *min = &s.min[i * groups];
    if constexpr (kStaged<F> == 2) {
      __m512bh even, odd;
      gguf::bf16_weight_pair<F>(row, kt, scale, min, even, odd);
      _mm512_store_si512(stage + i * 32, (__m512i)even);
      _mm512_store_si512(stage + kStageWords + i * 32, (__m512i)odd);
    } else {
      _mm512_store_si512(stage + i * 32, (__m512i)gguf::bf16_weights<F>(row, kt, scale, min));
    }
  }
}

// The blocks of the item after this one (the next item_rows weight rows, contiguous: static
// scheduling gives each thread consecutive items), a k tile's share of their cache lines at a
// time, so they are in cache when that item starts. An item reads its 32 rows at a stride of a
// row, which the hardware prefetchers do not follow: without this, each item waited on DRAM
// (embedded model's Q4_1 shapes, 30 layers, 2 threads, 2-core AMX Xeon: 7.5-8.6 ms at 9-16
// rows, 5.8-6.8 ms with it). Past the weight's end the hint is harmless.
struct PrefetchNext {
  const char* start;
  int64_t lines_per_tile;
  PrefetchNext(const uint8_t* blocks, int64_t row_bytes, int64_t n, int64_t k_tiles,
               int64_t item_rows)
      : start(reinterpret_cast<const char*>(blocks + n * row_bytes)),
        lines_per_tile((item_rows * row_bytes / 64 + k_tiles - 1) / k_tiles) {}
  void part(int64_t kt) const {
    prefetch_lines(start + kt * lines_per_tile * 64, lines_per_tile * 64);
  }
};

// A k tile's tile products call between(p) for p = 0 .. kPieces - 1, once each and in order,
// between their instructions: the next sub-blocks' decoding is cut into that many pieces.
constexpr int kPieces = 4;

// Calls tile_products(kt, stage, between) for the item's k tiles in order, with sub-block kt
// of weight rows [n0, n0 + rows) staged as bf16 in `stage` (rows past `rows`, up to
// item_rows, zero). Two staging buffers: the next sub-blocks are decoded into the other one,
// a piece of their rows between each two tile products, so the vector units decode while the
// tile unit multiplies. Decoding all the rows and then multiplying left each unit idle much
// of the time (32 rows, a 1.5B-shaped 7168 x 2048 Q4_K weight from L3, 2 threads: 0.61 ms
// decoding alone, 0.51 multiplying alone, 0.79 both; 0.71 interleaved). (Tried and slower:
// decoding each row whole into a [32, K] panel and loading tiles from it, 1.3x; prefetching
// the item's own rows 8 sub-blocks ahead, where PrefetchNext fetches the next item's.)
template <class F, class TileProducts>
void over_staged_sub_blocks(const GgufWeight& w, int64_t n0, int64_t rows, int64_t item_rows,
                            Scratch& s, TileProducts tile_products) {
  constexpr int64_t S = kStaged<F>;
  const int64_t row_bytes = w.K / F::kWeights * F::kBytes, groups = w.K / F::kGroup;
  for (int64_t i = 0; i < rows; ++i)
    gguf::read_params<F>(w.blocks + (n0 + i) * row_bytes, w.K, &s.scale[i * groups],
                         &s.min[i * groups]);
  for (bf16* stage : {s.stage[0], s.stage[1]})
    for (int64_t j = 0; j < S; ++j)
      std::fill(stage + j * kStageWords + rows * 32, stage + j * kStageWords + item_rows * 32,
                bf16{0});
  const int64_t k_tiles = w.K / 32;  // a multiple of S: K-quant rows are whole 256-k blocks
  const PrefetchNext next(w.blocks, row_bytes, n0 + rows, k_tiles, item_rows);
  stage_sub_blocks<F>(w, n0, 0, rows, 0, s, s.stage[0]);
  for (int64_t kt = 0; kt < k_tiles; kt += S) {
    const bf16* stage = s.stage[(kt / S) & 1];
    bf16* following = s.stage[(kt / S + 1) & 1];
    const bool more = kt + S < k_tiles;
    for (int64_t j = 0; j < S; ++j) {
      next.part(kt + j);
      tile_products(kt + j, stage + j * kStageWords, [&](int p) {
        const int64_t piece = j * kPieces + p, pieces = S * kPieces;
        if (more)
          stage_sub_blocks<F>(w, n0, rows * piece / pieces, rows * (piece + 1) / pieces,
                              kt + S, s, following);
      });
    }
  }
}

// Weight rows [n0, n0 + rows), rows <= 32, into out's columns n0...
template <class F>
void tile_item(const uint32_t* x_tiles, const GgufWeight& w, int64_t n0, int64_t rows,
               Scratch& s, const bf16* bias, bf16* out, int64_t M) {
  const int64_t halves = x_halves(M);
  _tile_zero(0);  // C tiles: 0 = A0 B0, 1 = A1 B0, 6 = A0 B1, 7 = A1 B1 (A: 2, 3; B: 4, 5)
  _tile_zero(1);
  _tile_zero(6);
  _tile_zero(7);
  auto products = [&](int64_t kt, const bf16* stage, auto between) {
    _tile_loadd(2, stage, 64);
    _tile_loadd(3, stage + kRows * 32, 64);
    _tile_loadd(4, x_tiles + kt * x_kt_words(halves), 64);
    _tile_dpbf16ps(0, 2, 4);
    between(0);
    _tile_dpbf16ps(1, 3, 4);
    between(1);
    if (halves == 2) {
      _tile_loadd(5, x_tiles + kt * x_kt_words(halves) + kTileWords, 64);
      _tile_dpbf16ps(6, 2, 5);
      between(2);
      _tile_dpbf16ps(7, 3, 5);
    } else {
      between(2);
    }
    between(3);
  };
  over_staged_sub_blocks<F>(w, n0, rows, kGroupRows, s, products);
  constexpr int64_t stride = kGroupRows * sizeof(float);
  _tile_stored(0, s.block, stride);
  _tile_stored(1, s.block + kRows * kGroupRows, stride);
  if (halves == 2) {
    _tile_stored(6, s.block + kRows, stride);
    _tile_stored(7, s.block + kRows * kGroupRows + kRows, stride);
  }
  write_transposed(s.block, kGroupRows, bias, out, w.N, 0, M, n0, rows);
}

// 33-64 rows of x: weight rows [n0, n0 + rows), rows <= 16, against three or four B tiles.
// One A tile (16 weight rows, tile 4) and three B tiles (5-7, the fourth reusing 5) leave
// tiles 0-3 for C, one per 16 rows of x; each sub-block is still dequantized once for all the
// rows. C is read back as block[i * 64 + m] (weight row i, x row m).
template <class F>
void wide_item(const uint32_t* x_tiles, const GgufWeight& w, int64_t n0, int64_t rows,
               Scratch& s, const bf16* bias, bf16* out, int64_t M) {
  const int64_t halves = x_halves(M);
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  auto products = [&](int64_t kt, const bf16* stage, auto between) {
    const uint32_t* b = x_tiles + kt * x_kt_words(halves);
    _tile_loadd(4, stage, 64);
    _tile_loadd(5, b, 64);
    _tile_loadd(6, b + kTileWords, 64);
    _tile_loadd(7, b + 2 * kTileWords, 64);
    _tile_dpbf16ps(0, 4, 5);
    between(0);
    _tile_dpbf16ps(1, 4, 6);
    between(1);
    _tile_dpbf16ps(2, 4, 7);
    between(2);
    if (halves == 4) {
      _tile_loadd(5, b + 3 * kTileWords, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
    between(3);
  };
  over_staged_sub_blocks<F>(w, n0, rows, kRows, s, products);
  constexpr int64_t kWide = 4 * kRows;  // block row: 64 x rows
  constexpr int64_t stride = kWide * sizeof(float);
  _tile_stored(0, s.block, stride);
  _tile_stored(1, s.block + kRows, stride);
  _tile_stored(2, s.block + 2 * kRows, stride);
  if (halves == 4) _tile_stored(3, s.block + 3 * kRows, stride);
  write_transposed(s.block, kWide, bias, out, w.N, 0, M, n0, rows);
}

template <class F>
void tile_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out, int64_t M) {
  const uint32_t* x_tiles = pack_rows(x, M, w.K, x_halves(M));
  const amx::TileConfig config = amx::eight_full_tiles();
  const bool wide = M > kGgufTileRows;
  const int64_t item_rows = wide ? kRows : kGroupRows;  // weight rows per item
  const int64_t items = (w.N + item_rows - 1) / item_rows;
#pragma omp parallel if (items > 1)
  {
    _tile_loadconfig(&config);  // tile state is per thread
    Scratch s(w.K / F::kGroup);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < items; ++item) {
      const int64_t n0 = item * item_rows, rows = std::min(item_rows, w.N - n0);
      if (wide)
        wide_item<F>(x_tiles, w, n0, rows, s, bias, out, M);
      else
        tile_item<F>(x_tiles, w, n0, rows, s, bias, out, M);
    }
    _tile_release();
  }
}

#endif  // __AMX_BF16__

}  // namespace

void gguf_tile_linear(const bf16* x, const GgufWeight& w, const bf16* bias, bf16* out,
                      int64_t M) {
#ifdef __AMX_BF16__
  if (M < 1 || M > kGgufWideTileRows)
    throw std::invalid_argument("gguf_tile_linear: 1-64 rows");
  gguf::dispatch(w.kind, [&](auto format) {
    tile_linear<decltype(format)>(x, w, bias, out, M);
  });
#else
  throw std::runtime_error("gguf_linear: built without AMX support");
#endif
}

}  // namespace meterserve
