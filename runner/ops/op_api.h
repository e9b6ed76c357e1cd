// What the program's operators (attention_op.cpp, shadow.cpp) take from ExecuTorch's kernel API:
// EXECUTORCH_LIBRARY registers an unboxed `Tensor& op(ctx, args..., out)` when the code is loaded.
#pragma once
#include <executorch/extension/kernel_util/make_boxed_from_unboxed_functor.h>
#include <executorch/runtime/core/exec_aten/util/tensor_util.h>

namespace llmnpu_ops {

using executorch::aten::ScalarType;
using executorch::aten::SizesType;
using executorch::aten::Tensor;
using executorch::runtime::Error;
using executorch::runtime::KernelRuntimeContext;

}  // namespace llmnpu_ops
