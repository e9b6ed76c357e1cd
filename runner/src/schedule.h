// The prefill's task graph and the policies that order it: a port of format/tasks.py `expand`
// and runtime/schedule.py `Scheduler` / `simulate`. The dependency rules are not restated here:
// they arrive as data (the sidecar's task table). The policies must decide exactly as the Python
// ones do; tests/test_native.py checks that on simulated time (--dry-run against `simulate`).
#pragma once
#include <set>
#include <string>
#include <vector>

#include "sidecar.h"

namespace llmnpu {

enum Processor { kNpu = 0, kCpu = 1 };
constexpr const char* kProcessorNames[] = {"npu", "cpu"};

struct Task {
  int id = 0, chunk = 0, step = 0;
  Processor processor = kCpu;
  std::vector<int> deps, users;
  double cost = 0.0;   // profiled seconds on its processor
};

enum class Policy { kInorder, kOverlap, kOoo, kCp };
// The policies that read the profiled task costs (without a profile they run in order).
inline bool uses_costs(Policy p) { return p == Policy::kOoo || p == Policy::kCp; }
Policy parse_policy(const std::string& name);   // throws InputError
const char* policy_name(Policy p);

// The tasks of a `chunks`-chunk prompt, in program order, with their profiled costs (at chunk
// positions shifted by `past_chunks`: a prompt after a past of that many chunks of tokens).
std::vector<Task> expand(const Sidecar& s, int chunks, double past_chunks = 0.0);

class Scheduler {
 public:
  Scheduler(const std::vector<Task>& tasks, Policy policy);
  // The next task for `p`, or nullptr when none may start now.
  const Task* pick(Processor p);
  void finish(const Task& t);
  bool finished() const { return done_ == tasks_.size(); }

 private:
  bool better(int a, int b) const;   // is a's (key, [ooo: rank,] -chunk, -step) larger than b's
  double score(int i) const;
  double key(int i) const { return policy_ == Policy::kCp ? rank_[i] : score(i); }
  const std::vector<Task>& tasks_;
  Policy policy_;
  std::vector<int> missing_;
  std::set<int> ready_[2];
  size_t done_ = 0;
  int running_ = 0;
  std::vector<int> order_;         // program order (chunk, step)
  size_t cursor_ = 0;              // inorder
  std::vector<int> queues_[2];     // overlap
  size_t heads_[2] = {0, 0};
  std::vector<double> rank_;       // ooo, cp: cost + the longest chain of costs after the task
};

struct Record {
  int task, chunk, step;
  Processor processor;
  double start, end;   // seconds from the run's start
};

// The policy on simulated time: each task takes its cost (runtime/schedule.py `simulate`).
std::vector<Record> simulate(const std::vector<Task>& tasks, Policy policy);

}  // namespace llmnpu
