// llmnpu_native.DecodeStep: the INT8 decode step of runtime/hf_decoder.py (Int8Decoder) as one C++ call.
//
// The step is ~45 small ops a layer on one token; from Python each costs a few microseconds of
// binding and interpreter work on top of its arithmetic, ~40 % of the step. Here the same kernels
// (int8_gemv.cpp's dynamic INT8 linear, torch's SDPA) run from C++, and the small work between them (the
// norms, RoPE, the K/V row, the outlier rows, the gated activation) is plain loops.
// runtime/hf_decoder.py's Python loop stays the reference (tests/test_decode.py).
#include <ATen/ATen.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "gated.h"
#include "int8_gemv.h"
#include "rms_norm.h"
#include "rope.h"

namespace {

using Packed = c10::intrusive_ptr<llmnpu::Int8Gemv>;

float bf16_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

struct Linear {
  Packed packed;
  at::Tensor rows;       // W^T in bf16 [K, N] for the per-token outliers (undefined: none)
  int64_t outliers = 0;

  // x [1, K] contiguous float: the `outliers` largest |x| go through their W^T rows, the rest through
  // the INT8 GEMM with the token's own scale (runtime/hf_decoder.py _Linear, in loops instead of ops)
  at::Tensor operator()(const at::Tensor& x) const {
    if (outliers == 0) return packed->forward(x);
    const int64_t K = x.size(1);
    const float* xp = x.const_data_ptr<float>();
    std::vector<int32_t> top(K);
    std::iota(top.begin(), top.end(), 0);
    std::nth_element(top.begin(), top.begin() + outliers, top.end(),
                     [xp](int32_t a, int32_t b) { return std::fabs(xp[a]) > std::fabs(xp[b]); });
    at::Tensor rest = x.clone();
    float* rp = rest.data_ptr<float>();
    for (int64_t j = 0; j < outliers; ++j) rp[top[j]] = 0.0f;
    at::Tensor y = packed->forward(rest);
    float* yp = y.data_ptr<float>();
    const int64_t N = y.size(1);
    const auto* w = reinterpret_cast<const uint16_t*>(rows.const_data_ptr<at::BFloat16>());
    for (int64_t j = 0; j < outliers; ++j) {
      const float v = xp[top[j]];
      const uint16_t* row = w + static_cast<int64_t>(top[j]) * N;
      for (int64_t n = 0; n < N; ++n) yp[n] += v * bf16_to_float(row[n]);
    }
    return y;
  }
};

Linear make_linear(Packed packed, at::Tensor rows, int64_t outliers) {
  TORCH_CHECK(outliers == 0 || (rows.dim() == 2 && rows.scalar_type() == at::kBFloat16),
              "DecodeStep: a linear with outliers needs its W^T rows in bf16");
  return Linear{std::move(packed), std::move(rows), outliers};
}

struct Block {
  at::Tensor norm1, norm2;
  Linear qkv, o, gate_up, down;
  at::Tensor q_norm, k_norm;   // per-head RMSNorm weights [d] of q and k before RoPE (Qwen3); empty: none
};

struct DecodeStep : torch::CustomClassHolder {
  int64_t heads, kv_heads, head_dim;
  double eps;
  std::string activation;   // "silu", "gelu" or "gelu_tanh"
  std::vector<Block> blocks;
  at::Tensor final_norm;
  Linear head;

  DecodeStep(int64_t heads, int64_t kv_heads, int64_t head_dim, double eps, std::string activation)
      : heads(heads), kv_heads(kv_heads), head_dim(head_dim), eps(eps), activation(std::move(activation)) {
    TORCH_CHECK(this->activation == "silu" || this->activation == "gelu" || this->activation == "gelu_tanh",
                "DecodeStep: unknown activation ", this->activation);
  }

  void add_block(at::Tensor norm1, at::Tensor norm2, Packed qkv, at::Tensor qkv_rows, int64_t qkv_k, Packed o,
                 at::Tensor o_rows, int64_t o_k, Packed gate_up, at::Tensor gate_up_rows, int64_t gate_up_k, Packed down,
                 at::Tensor down_rows, int64_t down_k, at::Tensor q_norm, at::Tensor k_norm) {
    TORCH_CHECK(q_norm.numel() == k_norm.numel() && (q_norm.numel() == 0 || q_norm.numel() == head_dim),
                "DecodeStep: q/k norms are both absent or both [head_dim]");
    blocks.push_back(Block{norm1, norm2, make_linear(qkv, qkv_rows, qkv_k), make_linear(o, o_rows, o_k),
                           make_linear(gate_up, gate_up_rows, gate_up_k), make_linear(down, down_rows, down_k),
                           q_norm.contiguous(), k_norm.contiguous()});
  }

  void set_head(at::Tensor norm, Packed packed, at::Tensor rows, int64_t outliers) {
    final_norm = norm;
    head = make_linear(packed, rows, outliers);
  }

  // RMSNorm of a [1, H] row
  at::Tensor norm(const at::Tensor& h, const at::Tensor& weight) const {
    at::Tensor out = at::empty_like(h);
    llmnpu::rms_norm_rows(h.const_data_ptr<float>(), weight.const_data_ptr<float>(), static_cast<float>(eps), 1,
                          h.size(1), out.data_ptr<float>());
    return out;
  }

  // act(gate) * up for gu = [gate | up] [1, 2F]
  at::Tensor gated(const at::Tensor& gu) const {
    const int64_t f = gu.size(1) / 2;
    if (activation != "silu") {
      at::Tensor gate = gu.narrow(1, 0, f);
      return at::gelu(gate, activation == "gelu_tanh" ? "tanh" : "none").mul_(gu.narrow(1, f, f));
    }
    at::Tensor out = at::empty({1, f}, gu.options());
    const float* g = gu.const_data_ptr<float>();
    llmnpu::silu_mul(g, g + f, out.data_ptr<float>(), f);
    return out;
  }

  // h [1, H]: the token's embedding; cos/sin [1, d]; writes row `pos` of every layer's K/V buffer
  // [1, KVH, size, d] and bumps each layer's length counter; returns the logits [1, V].
  at::Tensor step(at::Tensor h, at::Tensor cos, at::Tensor sin, int64_t pos, std::vector<at::Tensor> keys,
                  std::vector<at::Tensor> values, std::vector<at::Tensor> lengths) {
    TORCH_CHECK(head.packed, "DecodeStep: set_head was never called");
    TORCH_CHECK(keys.size() == blocks.size() && values.size() == blocks.size() && lengths.size() == blocks.size(),
                "DecodeStep: one K, V and length per layer");
    TORCH_CHECK(h.dim() == 2 && h.size(0) == 1 && h.scalar_type() == at::kFloat, "DecodeStep: h must be float [1, H]");
    const int64_t nq = heads, nkv = kv_heads, d = head_dim;
    h = h.contiguous().clone();   // the residual stream, updated in place
    const at::Tensor c = cos.contiguous(), s = sin.contiguous();
    const float* cp = c.const_data_ptr<float>();
    const float* sp = s.const_data_ptr<float>();
    at::Tensor q = at::empty({1, nq, 1, d}, h.options());
    std::vector<float> qk_normed;
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Block& b = blocks[i];
      const int64_t size = keys[i].size(2);
      TORCH_CHECK(pos >= 0 && pos < size, "DecodeStep: the cache is full");
      TORCH_CHECK(keys[i].is_contiguous() && values[i].is_contiguous() && keys[i].size(1) == nkv,
                  "DecodeStep: K/V buffers must be contiguous [1, KVH, size, d]");
      const at::Tensor qkv = b.qkv(norm(h, b.norm1));
      const float* y = qkv.const_data_ptr<float>();
      const float* qk = y;     // q and k heads as RoPE takes them
      if (b.q_norm.numel()) {
        qk_normed.resize((nq + nkv) * d);
        llmnpu::rms_norm_rows(y, b.q_norm.const_data_ptr<float>(), static_cast<float>(eps), nq, d, qk_normed.data());
        llmnpu::rms_norm_rows(y + nq * d, b.k_norm.const_data_ptr<float>(), static_cast<float>(eps), nkv, d,
                              qk_normed.data() + nq * d);
        qk = qk_normed.data();
      }
      float* kp = keys[i].data_ptr<float>();
      float* vp = values[i].data_ptr<float>();
      for (int64_t j = 0; j < nq; ++j) llmnpu::rope_row(qk + j * d, cp, sp, d, q.data_ptr<float>() + j * d);
      for (int64_t j = 0; j < nkv; ++j) {
        llmnpu::rope_row(qk + (nq + j) * d, cp, sp, d, kp + (j * size + pos) * d);
        std::memcpy(vp + (j * size + pos) * d, y + (nq + nkv + j) * d, d * sizeof(float));
      }
      const at::Tensor a = at::scaled_dot_product_attention(q, keys[i].narrow(2, 0, pos + 1),
                                                            values[i].narrow(2, 0, pos + 1), {}, 0.0, false, {}, true);
      h.add_(b.o(a.view({1, nq * d})));
      h.add_(b.down(gated(b.gate_up(norm(h, b.norm2)))));
      lengths[i].add_(1);
    }
    return head(norm(h, final_norm));
  }
};

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.class_<DecodeStep>("DecodeStep")
      .def(torch::init<int64_t, int64_t, int64_t, double, std::string>())
      .def("add_block", &DecodeStep::add_block)
      .def("set_head", &DecodeStep::set_head)
      .def("step", &DecodeStep::step);
}
