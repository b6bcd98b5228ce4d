// A mixture-of-experts router's picks from its logits, as moe.py SparseMoE._route states them
// (transformers' rounding): probabilities = softmax of the logits in fp32; the k largest in
// descending order (the lower expert id first among equal ones); divided by their sum when the
// family renormalizes; rounded to bf16 where the family rounds. One native call for the layer
// loop and the decode stack alike, so both route a token identically, bit for bit (the layer
// loop's five torch ops also cost ~80 us a layer at one token).
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "kernels.h"
#include "vec.h"

namespace meterserve {
namespace {

// probs[0, E) = softmax(logits): max, e^(x - max) (vec.h's exp), their sum in lane order,
// each divided by it.
void softmax_row(const bf16* logits, int64_t E, float* probs) {
  __m512 best = _mm512_set1_ps(-INFINITY);
  for (int64_t e = 0; e < E; e += kVecLanes)
    best = _mm512_mask_max_ps(best, lanes(E - e), best, load(logits + e, E - e));
  const __m512 max = _mm512_set1_ps(_mm512_reduce_max_ps(best));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t e = 0; e < E; e += kVecLanes) {
    const __mmask16 valid = lanes(E - e);
    const __m512 p = _mm512_maskz_mov_ps(valid, exp(_mm512_sub_ps(load(logits + e, E - e), max)));
    _mm512_mask_storeu_ps(probs + e, valid, p);
    sum = _mm512_add_ps(sum, p);
  }
  const __m512 total = _mm512_set1_ps(_mm512_reduce_add_ps(sum));
  for (int64_t e = 0; e < E; e += kVecLanes) {
    const __mmask16 valid = lanes(E - e);
    _mm512_mask_storeu_ps(probs + e, valid,
                          _mm512_div_ps(_mm512_maskz_loadu_ps(valid, probs + e), total));
  }
}

}  // namespace

void moe_route(const bf16* logits, int64_t tokens, int64_t E, int64_t k, bool normalize,
               bool round_weights, int64_t* picks, float* weights) {
  std::vector<float> probs(E);
  std::vector<int64_t> ids(E);
  for (int64_t t = 0; t < tokens; ++t) {
    softmax_row(logits + t * E, E, probs.data());
    std::iota(ids.begin(), ids.end(), 0);
    std::partial_sort(ids.begin(), ids.begin() + k, ids.end(), [&](int64_t a, int64_t b) {
      return probs[a] > probs[b] || (probs[a] == probs[b] && a < b);
    });
    float* w = weights + t * k;
    float total = 0.0f;
    for (int64_t j = 0; j < k; ++j) {
      picks[t * k + j] = ids[j];
      w[j] = probs[ids[j]];
      total += w[j];
    }
    for (int64_t j = 0; j < k; ++j) {
      if (normalize) w[j] /= total;
      if (round_weights) w[j] = to_float(from_float<bf16>(w[j]));
    }
  }
}

}  // namespace meterserve
