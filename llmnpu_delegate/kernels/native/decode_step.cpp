// llmnpu_native.DecodeStep: the INT8 decode step of runtime/decode.py (Int8Decoder) as one C++ call.
//
// The step is ~45 small ops a layer on one token; from Python each costs a few microseconds of
// binding and interpreter work on top of its arithmetic, about a quarter of the step. Here the same
// ops, in the same order and on the same kernels (fbgemm's dynamic INT8 linear, torch's SDPA), run
// from C++. runtime/decode.py's Python loop stays the reference (tests/test_native_kernels.py).
#include <ATen/ATen.h>
#include <ATen/native/quantized/PackedParams.h>
#include <torch/custom_class.h>
#include <torch/library.h>

#include <string>
#include <vector>

namespace {

using Packed = c10::intrusive_ptr<LinearPackedParamsBase>;

struct Linear {
  Packed packed;
  at::Tensor rows;       // W^T in bf16 [K, N] for the per-token outliers (undefined: none)
  int64_t outliers = 0;

  at::Tensor operator()(const at::Tensor& x) const {
    if (outliers == 0) return packed->apply_dynamic(x, false);
    const at::Tensor top = std::get<1>(x[0].abs().topk(outliers));
    at::Tensor y = packed->apply_dynamic(x.index_fill(1, top, 0.0), false);
    return y.addmm_(x.index_select(1, top), rows.index_select(0, top).to(at::kFloat));
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
                 at::Tensor down_rows, int64_t down_k) {
    blocks.push_back(Block{norm1, norm2, make_linear(qkv, qkv_rows, qkv_k), make_linear(o, o_rows, o_k),
                           make_linear(gate_up, gate_up_rows, gate_up_k), make_linear(down, down_rows, down_k)});
  }

  void set_head(at::Tensor norm, Packed packed, at::Tensor rows, int64_t outliers) {
    final_norm = norm;
    head = make_linear(packed, rows, outliers);
  }

  at::Tensor rope(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) const {
    const int64_t half = x.size(-1) / 2;
    at::Tensor rotated = at::cat({x.narrow(-1, half, half).neg(), x.narrow(-1, 0, half)}, -1);
    return x * cos + rotated * sin;
  }

  at::Tensor act(const at::Tensor& x) const {
    if (activation == "silu") return at::silu(x);
    return at::gelu(x, activation == "gelu_tanh" ? "tanh" : "none");
  }

  // h [1, H]: the token's embedding; cos/sin [1, d]; writes row `pos` of every layer's K/V buffer
  // [1, KVH, size, d] and bumps each layer's length counter; returns the logits [1, V].
  at::Tensor step(at::Tensor h, at::Tensor cos, at::Tensor sin, int64_t pos, std::vector<at::Tensor> keys,
                  std::vector<at::Tensor> values, std::vector<at::Tensor> lengths) {
    TORCH_CHECK(head.packed, "DecodeStep: set_head was never called");
    TORCH_CHECK(keys.size() == blocks.size() && values.size() == blocks.size() && lengths.size() == blocks.size(),
                "DecodeStep: one K, V and length per layer");
    const int64_t nq = heads, nkv = kv_heads, d = head_dim;
    const std::vector<int64_t> width{h.size(-1)};
    for (size_t i = 0; i < blocks.size(); ++i) {
      const Block& b = blocks[i];
      TORCH_CHECK(pos < keys[i].size(2), "DecodeStep: the cache is full");
      at::Tensor qkv = b.qkv(at::rms_norm(h, width, b.norm1, eps));
      at::Tensor q = qkv.narrow(1, 0, nq * d), k = qkv.narrow(1, nq * d, nkv * d), v = qkv.narrow(1, (nq + nkv) * d, nkv * d);
      at::Tensor qk = rope(at::cat({q, k}, -1).view({nq + nkv, d}), cos, sin);
      at::Tensor ks = keys[i].narrow(2, 0, pos + 1), vs = values[i].narrow(2, 0, pos + 1);
      ks.select(2, pos).copy_(qk.narrow(0, nq, nkv).view({1, nkv, d}));
      vs.select(2, pos).copy_(v.view({1, nkv, d}));
      at::Tensor a = at::scaled_dot_product_attention(qk.narrow(0, 0, nq).view({1, nq, 1, d}), ks, vs, {}, 0.0, false,
                                                      {}, true);
      h = h + b.o(a.view({1, nq * d}));
      at::Tensor gu = b.gate_up(at::rms_norm(h, width, b.norm2, eps));
      const int64_t f = gu.size(1) / 2;
      h = h + b.down(act(gu.narrow(1, 0, f)).mul_(gu.narrow(1, f, f)));
      lengths[i].add_(1);
    }
    return head(at::rms_norm(h, width, final_norm, eps));
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
