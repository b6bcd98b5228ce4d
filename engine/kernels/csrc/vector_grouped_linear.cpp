// A mixture-of-experts layer's grouped products on a CPU without AMX: each group of rows of x
// (one expert's tokens, after moe_experts sorted the pairs) by its expert's weight in
// amx_pack_weight's tile layout, the one layout the experts keep on every CPU with the kernels
// (amx_grouped_linear reads the same tensors on an AMX CPU).
//
// The work is split into (group, slices) items, each multiplied on one thread as the dense
// kernels multiply those columns: a group of 1-2 rows (a decode step's experts) by
// tile_slices_rows, four slices side by side as tile_small_linear walks them, so each thread
// streams four runs of weight at once; a larger group by vector_linear's register blocks,
// three slices an item (vector_slices_rows). Each thread takes a run of consecutive items
// holding about an even share of the work, so a decode step's eight one-row experts and a
// prefill's uneven groups both keep the threads busy to the end, and consecutive items of a
// group stream consecutive slices.
#include <omp.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "kernels.h"
#include "tile_matvec.h"
#include "vector_linear.h"

namespace meterserve {

namespace {

constexpr int64_t kSliceColumns = 16;
constexpr int64_t kFewRows = 2;     // groups of at most this many rows: tile_slices_rows
constexpr int64_t kFewSlices = 4;   // slices an item of such a group (tile_rows' walk)
constexpr int64_t kManySlices = 3;  // slices an item of a larger group (a register block)
// An item's cost beside its rows of x, for sharing items out: it also streams its weight
// (not tuned; 2 keeps a decode step's one-row items from counting as nearly free).
constexpr int64_t kItemCost = 2;

struct Item {
  int64_t first_row, rows, n_tile, slices;
  const bf16* weight;  // the group's expert
  int64_t cost() const { return rows + kItemCost; }
};

std::vector<Item> items_of(const bf16* weights, const int64_t* groups, int64_t num_groups,
                           int64_t N, int64_t K) {
  std::vector<Item> items;
  const int64_t slices = N / kSliceColumns;
  for (int64_t g = 0; g < num_groups; ++g) {
    const int64_t expert = groups[3 * g], first = groups[3 * g + 1], rows = groups[3 * g + 2];
    const int64_t step = rows <= kFewRows ? kFewSlices : kManySlices;
    for (int64_t s = 0; rows > 0 && s < slices; s += step)
      items.push_back({first, rows, s, std::min(step, slices - s), weights + expert * N * K});
  }
  return items;
}

// Thread t of T's items [first, last): consecutive, about an even share of the total cost.
std::pair<int64_t, int64_t> share(const std::vector<Item>& items, int t, int T) {
  int64_t total = 0;
  for (const Item& item : items) total += item.cost();
  const int64_t count = static_cast<int64_t>(items.size());
  int64_t first = count, done = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (first == count && done * T >= total * t) first = i;
    if (done * T >= total * (t + 1)) return {first, i};
    done += items[i].cost();
  }
  return {first, count};
}

}  // namespace

void vector_grouped_linear(const bf16* x, const bf16* weights, const int64_t* groups,
                           int64_t num_groups, bf16* out, int64_t N, int64_t K) {
  const std::vector<Item> items = items_of(weights, groups, num_groups, N, K);
#pragma omp parallel
  {
    const auto [first, last] = share(items, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t i = first; i < last; ++i) {
      const Item& item = items[i];
      const bf16* rows = x + item.first_row * K;
      bf16* rows_out = out + item.first_row * N;
      if (item.rows <= kFewRows)
        tile_slices_rows(rows, item.weight, rows_out, item.rows, N, K, item.n_tile, item.slices);
      else
        vector_slices_rows(rows, item.weight, rows_out, item.rows, N, K, item.n_tile,
                           item.slices);
    }
  }
}

}  // namespace meterserve
