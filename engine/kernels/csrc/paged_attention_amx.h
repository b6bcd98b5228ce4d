// Attention scores on AMX tiles, for paged_attention.cpp.
//
// One tile of 16 positions x one kv head is a matrix product per 32 dims of head_dim:
//   C[16 positions][group] += K[16 positions][32 dims] . Q[32 dims][group]
// K loads straight from the cache (16 consecutive slots, one slot row apart; so a tile must
// not cross a block: block_size % 16 == 0); Q is the group's queries as (even, odd) bf16
// pairs, built once per item (query_pairs). C is stored straight into the score rows
// [position][query head]. Products of bf16 are exact and accumulate in fp32, like the
// AVX-512 path; measured ~1.5x faster than that path's dot products plus reductions.
//
// Everything here needs the compiler's AMX support (-march=native on a CPU with AMX; without
// it this header declares nothing) and the OS's permission (amx::permitted); without either,
// paged_attention.cpp keeps to AVX-512.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "amx.h"
#include "numeric.h"

namespace meterserve {
namespace amx {

#ifdef __AMX_BF16__

// Tile registers as template arguments: the compiler's _tile_* macros paste their argument
// into the instruction text, so they take only literal numbers.
template <int kReg>
inline void tile_load(const void* base, int64_t stride_bytes) {
  asm volatile("tileloadd (%0,%1,1), %%tmm%c2" ::"r"(base), "r"(stride_bytes), "i"(kReg)
               : "memory");
}

template <int kReg>
inline void tile_store(void* base, int64_t stride_bytes) {
  asm volatile("tilestored %%tmm%c2, (%0,%1,1)" ::"r"(base), "r"(stride_bytes), "i"(kReg)
               : "memory");
}

template <int kReg>
inline void tile_zero() {
  asm volatile("tilezero %%tmm%c0" ::"i"(kReg));
}

// C += A . B over bf16 pairs, fp32 accumulate.
template <int kC, int kA, int kB>
inline void tile_dot() {
  asm volatile("tdpbf16ps %%tmm%c2, %%tmm%c1, %%tmm%c0" ::"i"(kC), "i"(kA), "i"(kB));
}

// Registers: 0 / 1 scores C, 2 / 3 keys K, 4 / 5 query pairs Q. Tiles are not renamed, so
// consecutive products alternate registers to overlap instead of waiting on each other.
inline void configure_score_tiles(int64_t group) {
  TileConfig config;
  for (int reg = 0; reg < 6; ++reg) config.rows[reg] = 16;
  config.colsb[0] = config.colsb[1] = static_cast<uint16_t>(group * 4);
  config.colsb[2] = config.colsb[3] = 64;
  config.colsb[4] = config.colsb[5] = static_cast<uint16_t>(group * 4);
  _tile_loadconfig(&config);
}

// pairs[r * group + g] = dims (2 r, 2 r + 1) of query head g, r in [0, head_dim / 2): rows
// [16 s, 16 s + 16) are the Q tile of the 32-dim step s. `query` is the group's first head.
inline void query_pairs(const bf16* query, int64_t group, int64_t head_dim, uint32_t* pairs) {
  for (int64_t g = 0; g < group; ++g) {
    const auto* q = reinterpret_cast<const uint32_t*>(query + g * head_dim);
    for (int64_t r = 0; r < head_dim / 2; ++r) pairs[r * group + g] = q[r];
  }
}

// scores[t * score_stride + g] = query_g . key(t), t in [0, 16), g in [0, group), using C
// register kC. `keys`: position 0's key row of the kv head, later ones key_stride bytes apart.
template <int kC>
inline void score_tile(const bf16* keys, int64_t key_stride, const uint32_t* pairs,
                       int64_t head_dim, int64_t group, float* scores, int64_t score_stride) {
  tile_zero<kC>();
  for (int64_t c = 0; c < head_dim; c += 64) {  // dims [c, c + 64): two 32-dim steps
    tile_load<2>(keys + c, key_stride);
    tile_load<4>(pairs + c / 2 * group, group * 4);
    tile_dot<kC, 2, 4>();
    if (c + 32 < head_dim) {  // dims [c + 32, c + 64)
      tile_load<3>(keys + c + 32, key_stride);
      tile_load<5>(pairs + (c + 32) / 2 * group, group * 4);
      tile_dot<kC, 3, 5>();
    }
  }
  tile_store<kC>(scores, score_stride * sizeof(float));
}

inline void release_tiles() { _tile_release(); }

#endif  // __AMX_BF16__

}  // namespace amx
}  // namespace meterserve
