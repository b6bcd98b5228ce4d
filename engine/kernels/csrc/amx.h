// What every AMX kernel here shares: the OS permission and the tile configuration record.
//
// Everything needs the compiler's AMX support (-march=native on a CPU with AMX); without it
// this header declares nothing and the AMX kernels compile to their fallbacks.
#pragma once

#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

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

#endif  // __AMX_BF16__

}  // namespace amx
}  // namespace meterserve
