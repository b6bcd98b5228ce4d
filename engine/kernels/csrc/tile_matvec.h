// The small-batch product over amx_pack_weight's tile layout (tile_matvec.cpp), for callers that
// split the columns among threads themselves (amx_grouped_linear's few-row experts).
#pragma once

#include <cstdint>

#include "numeric.h"

namespace meterserve {

// out[m, n] = x[m, :] . weight[n, :] for m < M (1 <= M <= kSmallBatchRows) and the columns of
// 16-column slices [n_tile, n_tile + num_slices), on the calling thread; x [M, K] and out
// [M, N] row-major. The same sums as tile_small_linear's for those columns.
void tile_slices_rows(const bf16* x, const bf16* packed, bf16* out, int64_t M, int64_t N,
                      int64_t K, int64_t n_tile, int64_t num_slices);

}  // namespace meterserve
