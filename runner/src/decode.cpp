#include "decode.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>

#include <executorch/extension/tensor/tensor.h>

#include "error.h"

namespace llmnpu {

using executorch::extension::from_blob;
using executorch::extension::TensorPtr;
using executorch::runtime::EValue;

Decoder::Decoder(const Sidecar& s, LoadedProgram& program, PrefillResult& prefill, bool release)
    : s_(s), module_(*program.modules[LoadedProgram::kDecodeModule]) {
  const int64_t h = s.kv_heads, d = s.head_dim, ctx = s.context;
  const int64_t t = prefill.k.at(0)->shape[2];
  for (int64_t l = 0; l < s.layers; ++l) {
    std::vector<float> k(static_cast<size_t>(h * d * ctx), 0.0f), v(static_cast<size_t>(h * ctx * d), 0.0f);
    const float* pk = prefill.k[l]->f32();
    const float* pv = prefill.v[l]->f32();
    // K transposed: written along the context (a write along d strides a page each)
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < d; ++j)
        for (int64_t p = 0; p < t; ++p) k[(i * d + j) * ctx + p] = pk[(i * t + p) * d + j];
    for (int64_t i = 0; i < h; ++i) std::memcpy(&v[i * ctx * d], pv + i * t * d, static_cast<size_t>(t * d) * sizeof(float));
    k_.push_back(std::move(k));
    v_.push_back(std::move(v));
    if (release) {
      prefill.k[l].reset();
      prefill.v[l].reset();
    }
  }
  length_ = t;
}

std::vector<float> Decoder::step(int64_t token) {
  const int64_t pos = length_, h = s_.kv_heads, d = s_.head_dim, ctx = s_.context;
  if (pos >= ctx)
    throw InputError("decode past the program's context of " + std::to_string(ctx) +
                     " tokens: export with a larger --context or generate fewer tokens");
  int64_t tok = token, position = pos;
  std::vector<TensorPtr> keep = {from_blob(&tok, {1, 1}, ScalarType::Long), from_blob(&position, {1}, ScalarType::Long)};
  for (auto& k : k_) keep.push_back(from_blob(k.data(), {1, static_cast<int>(h), static_cast<int>(d), static_cast<int>(ctx)}));
  for (auto& v : v_) keep.push_back(from_blob(v.data(), {1, static_cast<int>(h), static_cast<int>(ctx), static_cast<int>(d)}));
  std::vector<EValue> args(keep.begin(), keep.end());
  auto result = module_.execute(s_.decode_method, args);
  if (!result.ok())
    throw RunError("decode step at position " + std::to_string(pos) + ": method " + s_.decode_method + " returned " +
                   error_text(result.error()));
  const auto& outs = *result;
  if (outs.size() != static_cast<size_t>(1 + 2 * s_.layers))
    throw RunError("method " + s_.decode_method + " returned " + std::to_string(outs.size()) + " outputs");
  for (int64_t l = 0; l < s_.layers; ++l) {
    const float* kn = outs[1 + l].toTensor().const_data_ptr<float>();               // [1, H, 1, d]
    const float* vn = outs[1 + s_.layers + l].toTensor().const_data_ptr<float>();
    for (int64_t i = 0; i < h; ++i)
      for (int64_t j = 0; j < d; ++j) {
        k_[l][(i * d + j) * ctx + pos] = kn[i * d + j];
        v_[l][(i * ctx + pos) * d + j] = vn[i * d + j];
      }
  }
  length_ = pos + 1;
  const auto& logits = outs[0].toTensor();
  return std::vector<float>(logits.const_data_ptr<float>(), logits.const_data_ptr<float>() + logits.numel());
}

int64_t next_token(const std::vector<float>& logits, Sampling& sampling) {
  if (!sampling.temperature)
    return std::max_element(logits.begin(), logits.end()) - logits.begin();
  const double t = *sampling.temperature;
  const double top = *std::max_element(logits.begin(), logits.end());
  std::vector<double> p(logits.size());
  double sum = 0;
  for (size_t i = 0; i < p.size(); ++i) sum += p[i] = std::exp((logits[i] - top) / t);
  for (auto& x : p) x /= sum;
  std::vector<size_t> order(p.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return p[a] > p[b]; });
  std::vector<double> kept;
  double mass = 0;
  for (size_t i : order) {
    if (sampling.top_p < 1.0 && mass >= sampling.top_p) break;   // tokens before which the mass is below top_p
    kept.push_back(p[i]);
    mass += p[i];
  }
  std::discrete_distribution<size_t> draw(kept.begin(), kept.end());
  return static_cast<int64_t>(order[draw(sampling.rng)]);
}

}  // namespace llmnpu
