// vector_linear's register blocks on the calling thread, for callers that split the columns
// among threads themselves (vector_grouped_linear's experts).
#pragma once

#include <cstdint>

#include "numeric.h"

namespace meterserve {

// out[m, n] = x[m, :] . weight[n, :] for every m < M and the columns of 16-column slices
// [n_tile, n_tile + num_slices) of amx_pack_weight's tile layout, on the calling thread; x
// [M, K] and out [M, N] row-major. The same sums, bit for bit, as vector_linear's for those
// columns (each one fp32 sum over k in order).
void vector_slices_rows(const bf16* x, const bf16* packed, bf16* out, int64_t M, int64_t N,
                        int64_t K, int64_t n_tile, int64_t num_slices);

}  // namespace meterserve
