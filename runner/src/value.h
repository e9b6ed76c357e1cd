// A tensor the runner owns: the outputs of a method call are copied out of the method's planned
// memory (its next call overwrites them) into one of these.
#pragma once
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#include <executorch/runtime/core/exec_aten/exec_aten.h>

namespace llmnpu {

using executorch::aten::ScalarType;

struct Value {
  ScalarType dtype = ScalarType::Float;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  int64_t numel() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
  float* f32() { return reinterpret_cast<float*>(bytes.data()); }
  const float* f32() const { return reinterpret_cast<const float*>(bytes.data()); }
  int64_t* i64() { return reinterpret_cast<int64_t*>(bytes.data()); }
  const int64_t* i64() const { return reinterpret_cast<const int64_t*>(bytes.data()); }

  static std::shared_ptr<Value> make(ScalarType t, std::vector<int64_t> shape) {
    auto v = std::make_shared<Value>();
    v->dtype = t;
    v->shape = std::move(shape);
    size_t item = t == ScalarType::Long ? 8 : t == ScalarType::Float ? 4 : 1;
    // one spare byte: an empty tensor still gets a valid, non-null data pointer
    v->bytes.assign(static_cast<size_t>(v->numel()) * item + 1, 0);
    return v;
  }
};

using ValuePtr = std::shared_ptr<const Value>;

}  // namespace llmnpu
