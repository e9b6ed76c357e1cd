// The gated MLP's SiLU activation, out = silu(gate) * up, over n floats (out may be gate). Shared by
// the prefill's silu_mul_ op and the native decode step.
#pragma once
#include <cmath>
#include <cstdint>

#include "vec_exp.h"

namespace llmnpu {

inline void silu_mul(const float* gate, const float* up, float* out, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(gate + i);
    const __m512 e = exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(up + i)));
  }
#elif defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i + 8 <= n; i += 8) {
    const __m256 x = _mm256_loadu_ps(gate + i);
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x));
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_div_ps(x, _mm256_add_ps(one, e)), _mm256_loadu_ps(up + i)));
  }
#endif
  for (; i < n; ++i) out[i] = gate[i] / (1.0f + std::exp(-gate[i])) * up[i];
}

}  // namespace llmnpu
