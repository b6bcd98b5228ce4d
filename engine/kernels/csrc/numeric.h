// Element types the kernels read and write: float, or bfloat16 held as its 16 raw bits.
//
// bfloat16 results are rounded to nearest-even after every operation that PyTorch would round
// after, so a fused kernel gives the same bits as the chain of torch ops it replaces.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace meterserve {

struct bf16 {
  uint16_t bits;
};

inline float to_float(float x) { return x; }

inline float to_float(bf16 x) {
  uint32_t widened = static_cast<uint32_t>(x.bits) << 16;
  float out;
  std::memcpy(&out, &widened, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x);

template <>
inline float from_float<float>(float x) {
  return x;
}

// Round to nearest even, as torch's float -> bfloat16 conversion does (NaN stays NaN).
template <>
inline bf16 from_float<bf16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if (std::isnan(x)) return bf16{0x7FC0};
  uint32_t rounding_bias = 0x7FFF + ((bits >> 16) & 1);
  return bf16{static_cast<uint16_t>((bits + rounding_bias) >> 16)};
}

// Value as torch would store it in T: identity for float, one rounding for bfloat16.
template <typename T>
inline float round_to(float x) {
  return to_float(from_float<T>(x));
}

}  // namespace meterserve
