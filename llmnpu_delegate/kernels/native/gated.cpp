// llmnpu_native::silu_mul_: the gated MLP's activation, gate = silu(gate) * up, in place and in one
// pass. torch needs two (silu_, then mul_), each over a [C, ffn] buffer larger than L2; in the
// prefill they run beside the INT8 worker's weight stream and pay for every byte.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cmath>

#include "vec_exp.h"

namespace {

at::Tensor& silu_mul_(at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes(),
              "silu_mul_: gate and up must be float32 tensors of one shape");
  TORCH_CHECK(gate.is_contiguous(), "silu_mul_: gate must be contiguous (it is written in place)");
  const at::Tensor u = up.contiguous();
  float* g = gate.data_ptr<float>();
  const float* v = u.const_data_ptr<float>();
  const int64_t n = gate.numel();
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    const __m512 e = llmnpu::exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), x));
    _mm512_storeu_ps(g + i, _mm512_mul_ps(_mm512_div_ps(x, _mm512_add_ps(one, e)), _mm512_loadu_ps(v + i)));
  }
#endif
  for (; i < n; ++i) g[i] = g[i] / (1.0f + std::exp(-g[i])) * v[i];
  return gate;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("silu_mul_(Tensor(a!) gate, Tensor up) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("silu_mul_", &silu_mul_);
}
