// Sampling's passes over the vocabulary, fused per row (engine/sampling/native.py calls them).
//
// The torch path copies the sampled rows to fp32, divides by the temperature, takes a full
// softmax and a topk over it: four passes over [rows, vocab] in memory and ~5 ms a step at 64
// rows. Here a row is read at most three times from L2 and nothing of vocabulary size is
// written back:
//   top_candidates  x = logit / temperature (fp32 division, as torch's): the row's maximum, the
//                   sum of e^(x - max), and its k largest x with their token ids, ordered by
//                   descending x, ties by ascending id. Top-k / top-p / min-p then run over
//                   those k in Python (probabilities e^(x - max) / sum).
//   draw_whole      rows with neither top-k nor top-p: weights w = e^(x - max), 0 below min_p
//                   (w < min_p is p < min_p * p_max), and an inverse-CDF draw in ascending token
//                   id: the first token whose cumulative weight (fp64) exceeds u * total.
// -inf logits (a grammar's mask, a min_tokens ban) get weight exactly 0, never e^-87.
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct Candidate {
  float value;
  int32_t id;
};

// Larger value first, then smaller id: the order of a stable descending sort.
inline bool ranks_before(const Candidate& a, const Candidate& b) {
  return a.value > b.value || (a.value == b.value && a.id < b.id);
}

// Keeps at least the k best candidates seen (and every tie of the k-th) with a threshold below
// which a value cannot enter: each vector is filtered against it and its survivors appended
// with one compress-store, and the pool is cut back to its k best whenever it fills up, which
// raises the threshold. A row of n values admits O(k log(n / k)) of them.
class TopK {
 public:
  explicit TopK(int64_t k) : k_(k), values_(capacity() + kVecLanes), ids_(capacity() + kVecLanes) {}

  void offer(__m512 x, __mmask16 valid, int32_t first_id) {
    const __mmask16 finite = _mm512_mask_cmp_ps_mask(valid, x, _mm512_set1_ps(kMinusInf),
                                                     _CMP_NEQ_OQ);
    const __mmask16 keep =
        _mm512_mask_cmp_ps_mask(finite, x, _mm512_set1_ps(threshold_), _CMP_GE_OQ);
    if (!keep) return;
    const __m512i ids = _mm512_add_epi32(
        _mm512_set1_epi32(first_id),
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
    _mm512_mask_compressstoreu_ps(values_.data() + size_, keep, x);
    _mm512_mask_compressstoreu_epi32(ids_.data() + size_, keep, ids);
    size_ += __builtin_popcount(keep);
    if (size_ >= capacity()) cut(k_);
  }

  // The k best in rank order (fewer when the row has fewer finite values).
  const std::vector<Candidate>& finish() {
    gather();
    const int64_t keep = std::min<int64_t>(k_, pool_.size());
    if (keep < static_cast<int64_t>(pool_.size()))
      std::nth_element(pool_.begin(), pool_.begin() + (keep - 1), pool_.end(), ranks_before);
    pool_.resize(keep);
    std::sort(pool_.begin(), pool_.end(), ranks_before);
    return pool_;
  }

 private:
  int64_t capacity() const { return 4 * k_ + 64; }

  void gather() {
    pool_.resize(size_);
    for (int64_t i = 0; i < size_; ++i) pool_[i] = {values_[i], ids_[i]};
  }

  void cut(int64_t k) {
    gather();
    std::nth_element(pool_.begin(), pool_.begin() + (k - 1), pool_.end(), ranks_before);
    threshold_ = pool_[k - 1].value;
    // Ties of the k-th stay (the threshold admits them again): drop only what is below it.
    size_ = 0;
    for (const Candidate& c : pool_) {
      if (c.value < threshold_) continue;
      if (size_ >= capacity() - kVecLanes) break;  // a sea of ties: any of them will do
      values_[size_] = c.value;
      ids_[size_] = c.id;
      ++size_;
    }
  }

  int64_t k_;
  std::vector<float> values_;
  std::vector<int32_t> ids_;
  int64_t size_ = 0;
  std::vector<Candidate> pool_;
  float threshold_ = kMinusInf;
};

template <typename T>
inline __m512 scaled(const T* row, int64_t i, int64_t n, __m512 temperature) {
  return _mm512_div_ps(load(row + i, n - i), temperature);
}

// e^(x - max), exactly 0 where x is -inf.
inline __m512 weight(__m512 x, __m512 max) {
  const __mmask16 finite = _mm512_cmp_ps_mask(x, _mm512_set1_ps(kMinusInf), _CMP_NEQ_OQ);
  return _mm512_maskz_mov_ps(finite, exp(_mm512_sub_ps(x, max)));
}

template <typename T>
float row_max(const T* row, int64_t n, __m512 temperature) {
  __m512 best = _mm512_set1_ps(kMinusInf);
  for (int64_t i = 0; i < n; i += kVecLanes) {
    const __m512 x = scaled(row, i, n, temperature);
    best = _mm512_mask_max_ps(best, lanes(n - i), best, x);
  }
  return _mm512_reduce_max_ps(best);
}

template <typename T>
void top_candidates_row(const T* row, int64_t n, float temperature, int64_t k, float* max_out,
                        float* sum_out, float* values_out, int64_t* ids_out) {
  const __m512 t = _mm512_set1_ps(temperature);
  TopK top(k);
  for (int64_t i = 0; i < n; i += kVecLanes) top.offer(scaled(row, i, n, t), lanes(n - i), i);
  const std::vector<Candidate>& pool = top.finish();
  const float max = pool.empty() ? kMinusInf : pool[0].value;
  const __m512 max_v = _mm512_set1_ps(max);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += kVecLanes)
    sum = _mm512_mask_add_ps(sum, lanes(n - i), sum, weight(scaled(row, i, n, t), max_v));
  *max_out = max;
  *sum_out = _mm512_reduce_add_ps(sum);
  for (int64_t j = 0; j < k; ++j) {  // rows with fewer than k finite logits pad with -inf
    const bool real = j < static_cast<int64_t>(pool.size());
    values_out[j] = real ? pool[j].value : kMinusInf;
    ids_out[j] = real ? pool[j].id : 0;
  }
}

template <typename T>
int64_t draw_whole_row(const T* row, int64_t n, float temperature, float min_p, double uniform,
                       std::vector<float>& weights, std::vector<double>& blocks) {
  const __m512 t = _mm512_set1_ps(temperature);
  const __m512 max = _mm512_set1_ps(row_max(row, n, t));
  const __m512 floor = _mm512_set1_ps(min_p);
  const int64_t num_blocks = (n + kVecLanes - 1) / kVecLanes;
  weights.resize(num_blocks * kVecLanes);
  blocks.resize(num_blocks);
  double total = 0.0;
  int64_t last_kept = 0;
  for (int64_t b = 0, i = 0; b < num_blocks; ++b, i += kVecLanes) {
    __m512 w = _mm512_maskz_mov_ps(lanes(n - i), weight(scaled(row, i, n, t), max));
    const __mmask16 kept = _mm512_cmp_ps_mask(w, floor, _CMP_GE_OQ) &
                           _mm512_cmp_ps_mask(w, _mm512_setzero_ps(), _CMP_GT_OQ);
    w = _mm512_maskz_mov_ps(kept, w);
    _mm512_storeu_ps(weights.data() + i, w);
    if (kept) last_kept = i + 31 - __builtin_clz(static_cast<unsigned>(kept));
    blocks[b] = _mm512_reduce_add_ps(w);
    total += blocks[b];
  }
  // Walk the blocks in token order; the token is inside the first block whose end passes the
  // target. Rounding can leave the target at or past the total: the last kept token is meant.
  const double target = uniform * total;
  double cumulative = 0.0;
  for (int64_t b = 0, i = 0; b < num_blocks; ++b, i += kVecLanes) {
    if (cumulative + blocks[b] <= target) {
      cumulative += blocks[b];
      continue;
    }
    for (int64_t j = i; j < std::min(n, i + kVecLanes); ++j) {
      cumulative += weights[j];
      if (weights[j] > 0.0f && cumulative > target) return j;
    }
  }
  return last_kept;
}

}  // namespace

template <typename T>
void top_candidates(const T* logits, int64_t vocab, const int64_t* rows, int64_t num_rows,
                    const float* temperature, int64_t k, float* max_out, float* sum_out,
                    float* values_out, int64_t* ids_out) {
#pragma omp parallel for schedule(dynamic) if (num_rows >= 4)
  for (int64_t r = 0; r < num_rows; ++r)
    top_candidates_row(logits + rows[r] * vocab, vocab, temperature[r], k, max_out + r,
                       sum_out + r, values_out + r * k, ids_out + r * k);
}

template <typename T>
void draw_whole(const T* logits, int64_t vocab, const int64_t* rows, int64_t num_rows,
                const float* temperature, const float* min_p, const double* uniforms,
                int64_t* out) {
#pragma omp parallel if (num_rows >= 4)
  {
    std::vector<float> weights;
    std::vector<double> blocks;
#pragma omp for schedule(dynamic)
    for (int64_t r = 0; r < num_rows; ++r)
      out[r] = draw_whole_row(logits + rows[r] * vocab, vocab, temperature[r], min_p[r],
                              uniforms[r], weights, blocks);
  }
}

template void top_candidates<float>(const float*, int64_t, const int64_t*, int64_t,
                                    const float*, int64_t, float*, float*, float*, int64_t*);
template void top_candidates<bf16>(const bf16*, int64_t, const int64_t*, int64_t, const float*,
                                   int64_t, float*, float*, float*, int64_t*);
template void draw_whole<float>(const float*, int64_t, const int64_t*, int64_t, const float*,
                                const float*, const double*, int64_t*);
template void draw_whole<bf16>(const bf16*, int64_t, const int64_t*, int64_t, const float*,
                               const float*, const double*, int64_t*);

}  // namespace meterserve
