// llmnpu_native::rms_norm: a prefill CPU subgraph's RMSNorm as one op. The exported graph spells it
// as seven aten ops (pow, mean, add, rsqrt, mul, to, mul), each a pass over [C, hidden] and a
// round trip through the Python interpreter, which the INT8 worker's thread shares: ~0.4 ms a norm
// in the prefill against ~0.07 ms alone. runtime/fuse.py swaps the pattern for this op.
//
// llmnpu_native::add_rms_norm: the residual add before it too, s = x + (y + z) (z, the shadow
// branch's delta, optional or a scalar zero), returning s and its norm: one pass where there were
// two adds and the norm's read, rounding each sum as the aten adds do.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <tuple>

#include "rms_norm.h"

namespace {

void check_norm(const at::Tensor& x, const at::Tensor& weight) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat && x.dim() >= 1,
              "rms_norm: x and weight must be float32");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(-1), "rms_norm: weight must be [x.size(-1)]");
}

at::Tensor normed(const at::Tensor& xc, const at::Tensor& weight, double eps) {
  const at::Tensor wc = weight.contiguous();
  at::Tensor y = at::empty_like(xc);
  const int64_t n = xc.size(-1);
  llmnpu::rms_norm_rows(xc.const_data_ptr<float>(), wc.const_data_ptr<float>(), static_cast<float>(eps),
                        n ? xc.numel() / n : 0, n, y.data_ptr<float>());
  return y;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm(x, weight);
  return normed(x.contiguous(), weight, eps);
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& y,
                                                const std::optional<at::Tensor>& z, const at::Tensor& weight,
                                                double eps) {
  check_norm(x, weight);
  TORCH_CHECK(y.sizes() == x.sizes() && y.scalar_type() == at::kFloat, "add_rms_norm: y must be float like x");
  const bool scalar = z.has_value() && z->numel() == 1;
  TORCH_CHECK(!z.has_value() || (z->scalar_type() == at::kFloat && (scalar || z->sizes() == x.sizes())),
              "add_rms_norm: z must be float like x, or one value");
  const at::Tensor xc = x.contiguous(), yc = y.contiguous();
  const at::Tensor zc = z.has_value() && !scalar ? z->contiguous() : at::Tensor();
  at::Tensor s = at::empty_like(xc);
  const float* xp = xc.const_data_ptr<float>();
  const float* yp = yc.const_data_ptr<float>();
  float* sp = s.data_ptr<float>();
  const int64_t n = xc.numel();
  if (zc.defined()) {
    const float* zp = zc.const_data_ptr<float>();
    for (int64_t i = 0; i < n; ++i) sp[i] = xp[i] + (yp[i] + zp[i]);
  } else {
    const float zv = scalar ? z->item<float>() : 0.0f;
    if (scalar)
      for (int64_t i = 0; i < n; ++i) sp[i] = xp[i] + (yp[i] + zv);
    else
      for (int64_t i = 0; i < n; ++i) sp[i] = xp[i] + yp[i];
  }
  return {s, normed(s, weight, eps)};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor x, Tensor y, Tensor? z, Tensor weight, float eps) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
}
