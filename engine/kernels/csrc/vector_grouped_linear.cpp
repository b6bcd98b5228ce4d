// A mixture-of-experts layer's grouped products on a CPU without AMX: each group of rows of x
// (one expert's tokens, after moe_experts sorted the pairs) by its expert's row-major bf16
// weight, with AVX512-BF16 dot products (vector_tile.h, as the GGUF panels multiply).
//
// The work is split into (group, 16 weight rows) items over one parallel region, so a decode
// step's eight one-row experts keep both threads streaming weights, and a prefill's uneven
// groups are shared out dynamically. An item's 16 weight rows (32 KB at K = 1,024) stay in L2
// while every row of the group passes over them, four rows of x at a time.
#include <algorithm>

#include "kernels.h"
#include "vector_tile.h"

namespace meterserve {

namespace {
constexpr int64_t kItemRows = 16;  // weight rows per work item
}  // namespace

void vector_grouped_linear(const bf16* x, const bf16* weights, const int64_t* groups,
                           int64_t num_groups, bf16* out, int64_t N, int64_t K) {
  const int64_t per_group = N / kItemRows;
#pragma omp parallel for schedule(dynamic, 4)
  for (int64_t item = 0; item < num_groups * per_group; ++item) {
    const int64_t* group = groups + 3 * (item / per_group);
    const int64_t n0 = (item % per_group) * kItemRows, end = group[1] + group[2];
    const bf16* w = weights + (group[0] * N + n0) * K;
    for (int64_t r = group[1]; r < end; r += 4) {
      const int64_t rows = std::min<int64_t>(4, end - r);
      for (int64_t j = 0; j < kItemRows; j += 4)
        vector_tile_rows(x + r * K, rows, w + j * K, K, nullptr, out + r * N, N, n0 + j, 4);
    }
  }
}

}  // namespace meterserve
