// What every AMX kernel here shares: the OS permission, the tile configuration record and the
// 32 x 32 block product of amx_linear.cpp.
//
// Everything needs the compiler's AMX support (-march=native on a CPU with AMX); without it
// this header declares nothing and the AMX kernels compile to their fallbacks.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

#include "numeric.h"

namespace meterserve {
namespace amx {

#ifdef __AMX_BF16__

// Linux hands out AMX state only on request, once per process (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); false on kernels without AMX support.
inline bool permitted() {
  static const bool granted = [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return granted;
}

// The 64-byte record _tile_loadconfig reads (palette 1). Tile state is per thread: each thread
// loads a configuration before its first tile instruction and releases it after its last.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};  // bytes per row of each tile register
  uint8_t rows[16] = {};
};

// Tiles 0-7 all 16 rows x 64 bytes: what multiply_block needs loaded (amx_linear.cpp).
TileConfig eight_full_tiles();

// One 32 x 32 fp32 block, block[i * 32 + j] = sum_k x[m0 + i][k] * w[n0 + j][k]: x row-major
// [>= m0 + 32, K] bf16, w in amx_pack_weight's tile layout (kernels.h), K % 32 == 0. Tiles
// 0-7 must be configured (eight_full_tiles). Defined in amx_linear.cpp; gguf_panel.cpp calls
// it with a dequantized weight panel as x and tile-packed activations as w.
void multiply_block(const bf16* x, const bf16* packed, int64_t K, int64_t m0, int64_t n0,
                    float* block);

// A block put into out ([.., N] bf16), rounded once: out[m0 + r, n0 + c] = block[r * 32 + c]
// (+ bias[n0 + c]) for r < rows, c < cols (<= 32). Defined in amx_linear.cpp; gguf_panel.cpp
// writes its blocks with it too.
void write_block(const float* block, const bf16* bias, bf16* out, int64_t N, int64_t m0,
                 int64_t rows, int64_t n0, int64_t cols);

#endif  // __AMX_BF16__

}  // namespace amx
}  // namespace meterserve
