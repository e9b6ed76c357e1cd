// HF's rotate-half RoPE of one head's row: out = x * cos + rotate_half(x) * sin, with
// rotate_half(x) = [-x[d/2:], x[:d/2]]. Shared by the prefill's rope op and the native decode step.
#pragma once
#include <cstdint>

namespace llmnpu {

inline void rope_row(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t j = 0; j < half; ++j) out[j] = x[j] * cos[j] + (-x[j + half]) * sin[j];
  for (int64_t j = half; j < d; ++j) out[j] = x[j] * cos[j] + x[j - half] * sin[j];
}

}  // namespace llmnpu
