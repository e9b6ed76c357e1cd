// Prefill: a prompt's chunks through the program's methods on two worker threads, `npu` and `cpu`,
// in the order a policy picks (runtime/executor.py is the reference).
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

// `fail_at`: (chunk, step) whose method gets a wrong-shaped input (tests of the failure path).
PrefillResult prefill(const Sidecar& s, LoadedProgram& program, const std::vector<int64_t>& ids, Policy policy,
                      std::optional<std::pair<int, int>> fail_at = std::nullopt);

}  // namespace llmnpu
