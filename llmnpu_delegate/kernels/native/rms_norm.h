// RMSNorm rows as transformers' llama-family norms compute them: y = w * (x * rsqrt(mean(x^2) + eps)),
// in fp32. Shared by the prefill's fused norm op and the native decode step.
#pragma once
#include <cmath>
#include <cstdint>

namespace llmnpu {

inline void rms_norm_rows(const float* x, const float* w, float eps, int64_t rows, int64_t n, float* y) {
  constexpr int kLanes = 16;   // independent partial sums: the loop vectorises without reassociation
  for (int64_t r = 0; r < rows; ++r, x += n, y += n) {
    float part[kLanes] = {};
    int64_t i = 0;
    for (; i + kLanes <= n; i += kLanes)
      for (int l = 0; l < kLanes; ++l) part[l] += x[i + l] * x[i + l];
    float squares = 0.0f;
    for (int l = 0; l < kLanes; ++l) squares += part[l];
    for (; i < n; ++i) squares += x[i] * x[i];
    const float inv = 1.0f / std::sqrt(squares / static_cast<float>(n) + eps);
    for (int64_t j = 0; j < n; ++j) y[j] = w[j] * (x[j] * inv);
  }
}

}  // namespace llmnpu
