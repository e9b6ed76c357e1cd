// llmnpu_native::rope: a prefill attention subgraph's rotary embedding of q or k, and for k its append
// to the past. The exported graph spells one rotation as seven aten ops (mul, two slices, neg, cat,
// mul, add) over a strided view of the projection, and the new K/V as a cat of the past with it;
// this is one pass that reads the view in place and writes the contiguous result (after a copy of
// the past, when given). Built with -ffp-contract=off: each product and the sum round as the torch
// ops do, so the result is bit-identical to them. runtime/program.py swaps the pattern for this op.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstring>

#include "rope.h"

namespace {

// x [B, H, C, d] (any strides, unit stride in d); cos, sin C x d values; past [B, H, P, d] or none.
// Returns [B, H, P + C, d]: the past, then the rotated rows.
at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                const std::optional<at::Tensor>& past) {
  TORCH_CHECK(x.dim() == 4 && x.scalar_type() == at::kFloat, "rope: x must be float [B, H, C, d]");
  const int64_t B = x.size(0), H = x.size(1), C = x.size(2), d = x.size(3);
  TORCH_CHECK(d % 2 == 0, "rope: the head size must be even");
  TORCH_CHECK(cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat && cos.numel() == C * d &&
                  sin.numel() == C * d, "rope: cos and sin must be float with one [d] row per position of x");
  const at::Tensor xs = x.stride(3) == 1 ? x : x.contiguous();
  const at::Tensor cc = cos.contiguous(), sc = sin.contiguous();
  int64_t P = 0;
  at::Tensor pc;
  if (past.has_value()) {
    pc = past->contiguous();
    TORCH_CHECK(pc.dim() == 4 && pc.scalar_type() == at::kFloat && pc.size(0) == B && pc.size(1) == H &&
                    pc.size(3) == d, "rope: past must be float [B, H, P, d] like x");
    P = pc.size(2);
  }
  at::Tensor out = at::empty({B, H, P + C, d}, xs.options().memory_format(at::MemoryFormat::Contiguous));
  const float* xp = xs.const_data_ptr<float>();
  const float* cp = cc.const_data_ptr<float>();
  const float* sp = sc.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t h = 0; h < H; ++h) {
      float* dst = op + (b * H + h) * (P + C) * d;
      if (P) std::memcpy(dst, pc.const_data_ptr<float>() + (b * H + h) * P * d, P * d * sizeof(float));
      const float* src = xp + b * xs.stride(0) + h * xs.stride(1);
      for (int64_t c = 0; c < C; ++c)
        llmnpu::rope_row(src + c * xs.stride(2), cp + c * d, sp + c * d, d, dst + (P + c) * d);
    }
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("rope(Tensor x, Tensor cos, Tensor sin, Tensor? past=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("rope", &rope);
}
