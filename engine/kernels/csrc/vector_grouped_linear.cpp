// A mixture-of-experts layer's grouped products on a CPU without AMX: each group of rows of x
// (one expert's tokens, after moe_experts sorted the pairs) by its expert's row-major bf16
// weight, with AVX512-BF16 dot products (vector_tile.h, as the GGUF panels multiply).
//
// The work is split into (group, 16 weight rows) items; each thread takes a run of
// consecutive items holding about an even share of the rows to multiply, so a decode step's
// eight one-row experts and a prefill's uneven groups both keep the threads busy to the end.
// Knowing its next item, a thread fetches that item's weight rows into L2 while it multiplies
// the current one, in even slices, one before each 4 x 4 tile product (in one burst per
// quarter item instead, 8 rows an expert ran 1.28x slower: the products and the fetches did
// not overlap). An item's 16 weight rows (32 KB at K = 1,024) stay in L2 while every row of
// its group passes over them, four rows of x at a time.
#include <omp.h>

#include <algorithm>
#include <utility>

#include "kernels.h"
#include "vec.h"
#include "vector_tile.h"

namespace meterserve {

namespace {

constexpr int64_t kItemRows = 16;  // weight rows per work item
// An item's cost beside its rows of x, for sharing items out: it also streams its weight
// (not tuned; 2 keeps a decode step's one-row items from counting as nearly free).
constexpr int64_t kItemCost = 2;

// Item i: weight rows [n0(i), n0(i) + kItemRows) of group i / per_group's expert.
struct Items {
  const int64_t* groups;  // [G, 3]: (expert, first row, rows)
  const bf16* weights;    // [E, N, K]
  int64_t N, K, per_group;  // per_group: N / kItemRows
  const int64_t* group(int64_t item) const { return groups + 3 * (item / per_group); }
  int64_t n0(int64_t item) const { return item % per_group * kItemRows; }
  const bf16* weight(int64_t item) const { return weights + (group(item)[0] * N + n0(item)) * K; }
  int64_t cost(int64_t item) const { return group(item)[2] + kItemCost; }
};

// Thread t of T's items [first, last): consecutive, about an even share of the total cost.
std::pair<int64_t, int64_t> share(const Items& items, int64_t count, int t, int T) {
  int64_t total = 0;
  for (int64_t item = 0; item < count; ++item) total += items.cost(item);
  int64_t first = count, done = 0;
  for (int64_t item = 0; item < count; ++item) {
    if (first == count && done * T >= total * t) first = item;
    if (done * T >= total * (t + 1)) return {first, item};
    done += items.cost(item);
  }
  return {first, count};
}

// The next item's weight, fetched into L2 in even slices: one slice per call of step().
class SlicedFetch {
 public:
  SlicedFetch(const bf16* next, int64_t bytes, int64_t steps)
      : next_(reinterpret_cast<const char*>(next)),
        bytes_(next ? bytes : 0),
        slice_(((bytes + steps - 1) / steps + 63) / 64 * 64) {}
  void step() {
    if (fetched_ >= bytes_) return;
    prefetch_lines_l2(next_ + fetched_, std::min(slice_, bytes_ - fetched_));
    fetched_ += slice_;
  }

 private:
  const char* next_;
  int64_t bytes_, slice_, fetched_ = 0;
};

// out[r, n0 .. n0 + kItemRows) for the group's rows r: 4 x 4 tile products over the item's
// weight rows w, a fetch slice of the next item before each.
void multiply_item(const bf16* x, const bf16* w, const int64_t* group, int64_t n0, int64_t N,
                   int64_t K, bf16* out, SlicedFetch& fetch) {
  const int64_t end = group[1] + group[2];
  for (int64_t r = group[1]; r < end; r += 4) {
    const int64_t rows = std::min<int64_t>(4, end - r);
    for (int64_t j = 0; j < kItemRows; j += 4) {
      fetch.step();
      vector_tile_rows(x + r * K, rows, w + j * K, K, nullptr, out + r * N, N, n0 + j, 4);
    }
  }
}

}  // namespace

void vector_grouped_linear(const bf16* x, const bf16* weights, const int64_t* groups,
                           int64_t num_groups, bf16* out, int64_t N, int64_t K) {
  const Items items{groups, weights, N, K, N / kItemRows};
  const int64_t count = num_groups * items.per_group;
#pragma omp parallel
  {
    const auto [first, last] = share(items, count, omp_get_thread_num(), omp_get_num_threads());
    for (int64_t item = first; item < last; ++item) {
      const int64_t* group = items.group(item);
      const int64_t products = std::max<int64_t>(1, (group[2] + 3) / 4 * (kItemRows / 4));
      SlicedFetch fetch(item + 1 < last ? items.weight(item + 1) : nullptr,
                        kItemRows * K * sizeof(bf16), products);
      multiply_item(x, items.weight(item), group, items.n0(item), N, K, out, fetch);
    }
  }
}

}  // namespace meterserve
