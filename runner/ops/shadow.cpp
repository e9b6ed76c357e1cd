// The program's shadow-branch operators (lower/shadow_branches.py builds the graph around them):
//
//   llmnpu::shadow_hits.out(Tensor x, float clip, *, Tensor(a!) out) -> Tensor(a!)
//     out[k] = max over rows of |x - clamp(x, -clip, clip)| in channel k: > 0 exactly where a value
//     of that input channel crossed the clip (the runner adds those cold channels' rows)
//   llmnpu::shadow_gather.out(Tensor x, Tensor hot, float clip, *, Tensor(a!) out) -> Tensor(a!)
//     out[.., j] = the residue x - clamp(x, -clip, clip) of input channel hot[j]
//
// One pass over the input each, where the same ops as aten (clamp, sub, abs, amax, index_select)
// made five, the amax on ExecuTorch's portable kernel. Results are the aten ops' bits: the residue
// is one subtraction, and a maximum does not depend on order.
#include <cstdint>
#include <cstring>

#include "op_api.h"

namespace llmnpu_ops {
namespace {

constexpr int W = 4;   // SSE2 or NEON: the pass is memory-bound
typedef float vf __attribute__((vector_size(W * 4)));

inline float residue(float v, float clip) { return v - (v < -clip ? -clip : v > clip ? clip : v); }

// |residue| lane by lane, with the scalar's exact operations
inline vf magnitude(vf v, vf lo, vf hi) {
  const vf clamped = v < lo ? lo : (v > hi ? hi : v);
  const vf r = v - clamped;
  return r < vf{} ? -r : r;
}

bool float_rows(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& out, const char* op) {
  ET_KERNEL_CHECK_MSG(ctx, x.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float &&
                               x.dim() >= 1 && executorch::runtime::tensor_is_default_dim_order(x),
                      InvalidArgument, false, "%s: a float32 input of default layout", op);
  return true;
}

Tensor& shadow_hits_out(KernelRuntimeContext& ctx, const Tensor& x, double clip, Tensor& out) {
  if (!float_rows(ctx, x, out, "llmnpu::shadow_hits")) return out;
  const int64_t k = x.size(x.dim() - 1), m = k > 0 ? x.numel() / k : 0;
  const SizesType size[1] = {static_cast<SizesType>(k)};
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {size, 1}) == Error::Ok, InvalidArgument, out);
  const float c = static_cast<float>(clip);
  const float* xs = x.const_data_ptr<float>();
  float* h = out.mutable_data_ptr<float>();
  std::memset(h, 0, static_cast<size_t>(k) * sizeof(float));
  const vf lo = vf{} - c, hi = vf{} + c;
  for (int64_t r = 0; r < m; ++r) {
    const float* row = xs + r * k;
    int64_t j = 0;
    for (; j + W <= k; j += W) {
      vf v, acc;
      std::memcpy(&v, row + j, sizeof v);
      std::memcpy(&acc, h + j, sizeof acc);
      const vf a = magnitude(v, lo, hi);
      acc = a > acc ? a : acc;
      std::memcpy(h + j, &acc, sizeof acc);
    }
    for (; j < k; ++j) {
      const float r0 = residue(row[j], c), a = r0 < 0 ? -r0 : r0;
      if (a > h[j]) h[j] = a;
    }
  }
  return out;
}

Tensor& shadow_gather_out(KernelRuntimeContext& ctx, const Tensor& x, const Tensor& hot, double clip, Tensor& out) {
  if (!float_rows(ctx, x, out, "llmnpu::shadow_gather")) return out;
  ET_KERNEL_CHECK_MSG(ctx, hot.scalar_type() == ScalarType::Long && hot.dim() == 1, InvalidArgument, out,
                      "llmnpu::shadow_gather: int64 channel indices [h]");
  const int64_t k = x.size(x.dim() - 1), m = k > 0 ? x.numel() / k : 0, n = hot.size(0);
  const int64_t* idx = hot.const_data_ptr<int64_t>();
  for (int64_t j = 0; j < n; ++j)
    ET_KERNEL_CHECK_MSG(ctx, idx[j] >= 0 && idx[j] < k, InvalidArgument, out,
                        "llmnpu::shadow_gather: channel %lld outside the input's %lld", static_cast<long long>(idx[j]),
                        static_cast<long long>(k));
  SizesType sizes[executorch::runtime::kTensorDimensionLimit];
  for (int64_t d = 0; d + 1 < x.dim(); ++d) sizes[d] = static_cast<SizesType>(x.size(d));
  sizes[x.dim() - 1] = static_cast<SizesType>(n);
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {sizes, static_cast<size_t>(x.dim())}) == Error::Ok,
                  InvalidArgument, out);
  const float c = static_cast<float>(clip);
  const float* xs = x.const_data_ptr<float>();
  float* o = out.mutable_data_ptr<float>();
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j) o[r * n + j] = residue(xs[r * k + idx[j]], c);
  return out;
}

}  // namespace
}  // namespace llmnpu_ops

EXECUTORCH_LIBRARY(llmnpu, "shadow_hits.out", llmnpu_ops::shadow_hits_out);
EXECUTORCH_LIBRARY(llmnpu, "shadow_gather.out", llmnpu_ops::shadow_gather_out);
