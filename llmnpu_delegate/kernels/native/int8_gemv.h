// llmnpu_native.Int8Gemv: decode's dynamic INT8 linear (int8_gemv.cpp), shared with decode_step.cpp.
#pragma once

#include <ATen/ATen.h>
#include <torch/custom_class.h>

#include <optional>
#include <string>

namespace llmnpu {

// One INT8 weight [N, K] (codes in -127..127, a float scale per output channel) packed once. Each call
// quantizes x [M, K] with its own range to u8 with a zero point and returns
// (sum_k x_u8 W - zero * sum_k W) * x_scale * w_scale + bias, the integer part exact on every path.
struct Int8Gemv : torch::CustomClassHolder {
  Int8Gemv(const at::Tensor& w_q, const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
           const std::string& path);

  at::Tensor forward(const at::Tensor& x) const;             // float [M, K] -> float [M, N]
  at::Tensor accumulate(const at::Tensor& x_u8) const;       // u8 [M, K] -> int32 sum_k x_u8 W [M, N]
  std::string path_name() const { return path_; }

  int64_t n = 0, k = 0;

 private:
  void accumulate_into(const uint8_t* x, int64_t m, int32_t* out) const;

  std::string path_;
  int isa_ = 0;
  at::Tensor packed_;    // s8 [panels][ceil(K / 4)][8][4]: one 32-byte vector per (panel of 8 columns, k group),
                         // panels = ceil(N / 32) * 4 (zeros past N) so the x86 loops take four at a time
  at::Tensor colsum_;    // int32 [N]: sum_k W[n, k]
  at::Tensor w_scale_;   // float [N]
  at::Tensor bias_;      // float [N], or undefined
};

}  // namespace llmnpu
