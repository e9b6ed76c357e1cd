// Prefill: a prompt's chunks through the program's methods on two worker threads, `npu` and `cpu`,
// in the order a policy picks (runtime/schedule.py is the reference).
#pragma once
#include <optional>
#include <utility>
#include <vector>

#include "methods.h"
#include "schedule.h"

namespace llmnpu {

struct PrefillResult {
  std::vector<float> logits;              // the last prompt token's, [vocab]
  std::vector<ValuePtr> k, v;             // per layer [1, KVH, T, d], T = prompt length
  int chunks = 0;
  std::vector<Record> records;
  double wall_s = 0, decision_s = 0;
  long decisions = 0;
};

// The K/V of tokens before a prompt: per layer [1, KVH, P, d].
struct Past {
  std::vector<ValuePtr> k, v;
  int64_t length() const { return k.empty() ? 0 : k[0]->shape[2]; }
};

// Prefill `ids` after `past` (none: an empty one); the result's K/V then cover the past's tokens
// and the prompt's. `fail_at`: (chunk, step) whose method gets a wrong-shaped input (tests of the
// failure path).
PrefillResult prefill(const Sidecar& s, LoadedProgram& program, const std::vector<int64_t>& ids, Policy policy,
                      std::optional<std::pair<int, int>> fail_at = std::nullopt, const Past* past = nullptr);

// The first `t` positions of per-layer K/V [1, H, T, d], copied.
Past first_tokens(const std::vector<ValuePtr>& k, const std::vector<ValuePtr>& v, int64_t t);

}  // namespace llmnpu
