// llmnpu_native::rms_norm: a prefill CPU subgraph's RMSNorm as one op. The exported graph spells it
// as seven aten ops (pow, mean, add, rsqrt, mul, to, mul), each a pass over [C, hidden] and a
// round trip through the Python interpreter, which the INT8 worker's thread shares: ~0.4 ms a norm
// in the prefill against ~0.07 ms alone. runtime/program.py swaps the pattern for this op.
#include <torch/library.h>
#include <ATen/ATen.h>

#include "rms_norm.h"

namespace {

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm: x and weight must be float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [x.size(-1)]");
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.size(-1);
  llmnpu::rms_norm_rows(xc.const_data_ptr<float>(), wc.const_data_ptr<float>(), static_cast<float>(eps),
                        n ? xc.numel() / n : 0, n, y.data_ptr<float>());
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
}
