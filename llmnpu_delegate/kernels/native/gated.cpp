// llmnpu_native::silu_mul_: the gated MLP's activation, gate = silu(gate) * up, in place and in one
// pass. torch needs two (silu_, then mul_), each over a [C, ffn] buffer larger than L2; in the
// prefill they run beside the INT8 worker's weight stream and pay for every byte.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "gated.h"

namespace {

at::Tensor& silu_mul_(at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.scalar_type() == at::kFloat && up.scalar_type() == at::kFloat && gate.sizes() == up.sizes(),
              "silu_mul_: gate and up must be float32 tensors of one shape");
  TORCH_CHECK(gate.is_contiguous(), "silu_mul_: gate must be contiguous (it is written in place)");
  const at::Tensor u = up.contiguous();
  llmnpu::silu_mul(gate.data_ptr<float>(), u.const_data_ptr<float>(), gate.data_ptr<float>(), gate.numel());
  return gate;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("silu_mul_(Tensor(a!) gate, Tensor up) -> Tensor(a!)");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("silu_mul_", &silu_mul_);
}
