// The program's attention operator (the shadow branch's two are in shadow.cpp), registered with
// ExecuTorch's kernel registry when this code is loaded: linked into llmnpu-runner, and built as
// libllmnpu_ops.so for the Python runner (which loads it beside ExecuTorch's Python runtime,
// runtime/program_ops.py).
//
//   llmnpu::chunk_attention.out(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling,
//                               float softcap, *, Tensor(a!) out) -> Tensor(a!)
//
// The same schema as the engine's op (kernels/attention.py); the export keeps it in a CPU method
// only where this kernel takes it (lower/cpu_subgraphs.py), so a failed check here is a program
// that was edited or written by another exporter.
#include "attention.h"
#include "op_api.h"

namespace llmnpu_ops {
namespace {

Tensor& chunk_attention_out(KernelRuntimeContext& ctx, const Tensor& q, const Tensor& k, const Tensor& v,
                            const Tensor& mask, double scaling, double softcap, Tensor& out) {
  ET_KERNEL_CHECK_MSG(ctx, q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 &&
                               v.size(0) == 1, InvalidArgument, out, "llmnpu::chunk_attention: q, k, v of rank 4, batch 1");
  const int64_t heads = q.size(1), rows = q.size(2), dim = q.size(3), kv_heads = k.size(1), keys = k.size(2);
  ET_KERNEL_CHECK_MSG(ctx, k.size(3) == dim && v.size(1) == kv_heads && v.size(2) == keys && v.size(3) == dim &&
                               kv_heads > 0 && heads % kv_heads == 0, InvalidArgument, out,
                      "llmnpu::chunk_attention: k and v must be [1, KVH, L, d] with H a multiple of KVH");
  ET_KERNEL_CHECK_MSG(ctx, q.scalar_type() == ScalarType::Float && k.scalar_type() == ScalarType::Float &&
                               v.scalar_type() == ScalarType::Float && out.scalar_type() == ScalarType::Float,
                      InvalidArgument, out, "llmnpu::chunk_attention: float32 q, k, v and out");
  ET_KERNEL_CHECK_MSG(ctx, (mask.scalar_type() == ScalarType::Bool || mask.scalar_type() == ScalarType::Float) &&
                               mask.dim() >= 2 && mask.size(mask.dim() - 1) == keys &&
                               mask.size(mask.dim() - 2) == rows && mask.numel() == rows * keys,
                      InvalidArgument, out, "llmnpu::chunk_attention: one bool or additive mask [C, L] for all heads");
  ET_KERNEL_CHECK_MSG(ctx, softcap == 0.0 && chunk_attention_supports(dim), InvalidArgument, out,
                      "llmnpu::chunk_attention: no softcapping, head size a multiple of 16");
  ET_KERNEL_CHECK(ctx, executorch::runtime::tensor_is_default_dim_order(q) &&
                           executorch::runtime::tensor_is_default_dim_order(k) &&
                           executorch::runtime::tensor_is_default_dim_order(v) &&
                           executorch::runtime::tensor_is_default_dim_order(mask), InvalidArgument, out);
  const SizesType sizes[4] = {1, static_cast<SizesType>(rows), static_cast<SizesType>(heads),
                              static_cast<SizesType>(dim)};
  ET_KERNEL_CHECK(ctx, executorch::runtime::resize_tensor(out, {sizes, 4}) == Error::Ok, InvalidArgument, out);
  const bool keep = mask.scalar_type() == ScalarType::Bool;
  chunk_attention_f32(q.const_data_ptr<float>(), k.const_data_ptr<float>(), v.const_data_ptr<float>(),
                      keep ? reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>()) : nullptr,
                      keep ? nullptr : mask.const_data_ptr<float>(), AttentionShape{heads, kv_heads, rows, keys, dim},
                      static_cast<float>(scaling), out.mutable_data_ptr<float>());
  return out;
}

}  // namespace
}  // namespace llmnpu_ops

EXECUTORCH_LIBRARY(llmnpu, "chunk_attention.out", llmnpu_ops::chunk_attention_out);

// For the Python runner: which vector path the kernel takes (it reports it beside its timings).
extern "C" const char* llmnpu_ops_attention_isa() { return llmnpu_ops::chunk_attention_isa(); }
