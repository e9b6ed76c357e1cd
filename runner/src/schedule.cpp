#include "schedule.h"

#include <algorithm>
#include <map>

#include "error.h"

namespace llmnpu {

Policy parse_policy(const std::string& name) {
  if (name == "inorder") return Policy::kInorder;
  if (name == "overlap") return Policy::kOverlap;
  if (name == "ooo") return Policy::kOoo;
  if (name == "cp") return Policy::kCp;
  throw InputError("unknown policy '" + name + "': use one of inorder, overlap, ooo, cp");
}

const char* policy_name(Policy p) {
  return p == Policy::kInorder ? "inorder" : p == Policy::kOverlap ? "overlap" : p == Policy::kOoo ? "ooo" : "cp";
}

std::vector<Task> expand(const Sidecar& s, int chunks, double past_chunks) {
  const auto& table = s.tasks;
  std::vector<Task> tasks;
  std::map<int, int> previous;   // step -> its task in the chunk before
  for (int i = 0; i < chunks; ++i) {
    std::map<int, int> current;
    for (int j : i == chunks - 1 ? table.needed_final : table.needed_kv) {
      Task t;
      t.id = static_cast<int>(tasks.size());
      t.chunk = i;
      t.step = j;
      t.processor = table.processors[j] == "npu" ? kNpu : kCpu;
      for (int d : table.after[j]) {
        auto it = current.find(d);
        if (it == current.end()) throw InputError("the sidecar's task table is inconsistent: export the program again");
        t.deps.push_back(it->second);
      }
      if (i > 0)
        for (int d : table.after_previous[j]) {
          auto it = previous.find(d);
          if (it == previous.end()) throw InputError("the sidecar's task table is inconsistent: export the program again");
          t.deps.push_back(it->second);
        }
      t.cost = s.has_profile ? profile_cost(s, j, i + past_chunks) : 0.0;
      current[j] = t.id;
      tasks.push_back(std::move(t));
    }
    previous = std::move(current);
  }
  for (const auto& t : tasks)
    for (int d : t.deps) tasks[d].users.push_back(t.id);
  return tasks;
}

Scheduler::Scheduler(const std::vector<Task>& tasks, Policy policy) : tasks_(tasks), policy_(policy) {
  for (const auto& t : tasks) {
    missing_.push_back(static_cast<int>(t.deps.size()));
    if (t.deps.empty()) ready_[t.processor].insert(t.id);
    order_.push_back(t.id);
  }
  std::sort(order_.begin(), order_.end(), [&](int a, int b) {
    return std::make_pair(tasks[a].chunk, tasks[a].step) < std::make_pair(tasks[b].chunk, tasks[b].step);
  });
  for (int i : order_) queues_[tasks[i].processor].push_back(i);
  if (uses_costs(policy)) {   // tasks come in a topological order: users after their deps
    rank_.assign(tasks.size(), 0.0);
    for (auto t = tasks.rbegin(); t != tasks.rend(); ++t) {
      double longest = 0.0;
      for (int u : t->users) longest = std::max(longest, rank_[u]);
      rank_[t->id] = t->cost + longest;
    }
  }
}

double Scheduler::score(int i) const {
  // The paper's heuristic: the NPU is the critical path. A CPU task scores the NPU time it makes
  // ready; an NPU task scores minus its own time (short ones first).
  const Task& t = tasks_[i];
  if (t.processor == kNpu) return -t.cost;
  double sum = 0.0;
  for (int u : t.users)
    if (tasks_[u].processor == kNpu && missing_[u] == 1) sum += tasks_[u].cost;
  return sum;
}

bool Scheduler::better(int a, int b) const {
  double sa = key(a), sb = key(b);
  if (sa != sb) return sa > sb;
  // ooo's ties (the same subgraph of different chunks scores alike): the longer chain after it first
  if (policy_ == Policy::kOoo && rank_[a] != rank_[b]) return rank_[a] > rank_[b];
  if (tasks_[a].chunk != tasks_[b].chunk) return tasks_[a].chunk < tasks_[b].chunk;
  return tasks_[a].step < tasks_[b].step;
}

const Task* Scheduler::pick(Processor p) {
  auto& ready = ready_[p];
  if (ready.empty()) return nullptr;
  int choice = -1;
  if (policy_ == Policy::kInorder) {
    if (running_ || cursor_ >= order_.size() || !ready.count(order_[cursor_])) return nullptr;
    choice = order_[cursor_++];
  } else if (policy_ == Policy::kOverlap) {
    auto& queue = queues_[p];
    if (heads_[p] >= queue.size() || !ready.count(queue[heads_[p]])) return nullptr;
    choice = queue[heads_[p]++];
  } else {
    for (int i : ready)
      if (choice < 0 || better(i, choice)) choice = i;
  }
  ready.erase(choice);
  ++running_;
  return &tasks_[choice];
}

void Scheduler::finish(const Task& t) {
  ++done_;
  --running_;
  for (int u : t.users)
    if (--missing_[u] == 0) ready_[tasks_[u].processor].insert(u);
}

std::vector<Record> simulate(const std::vector<Task>& tasks, Policy policy) {
  Scheduler sched(tasks, policy);
  std::vector<Record> records;
  struct Busy { bool on = false; double end = 0, start = 0; const Task* task = nullptr; } busy[2];
  double now = 0.0;
  while (!sched.finished()) {
    for (Processor p : {kNpu, kCpu}) {
      if (busy[p].on) continue;
      if (const Task* t = sched.pick(p)) busy[p] = {true, now + t->cost, now, t};
    }
    int p = -1;
    for (int q : {kNpu, kCpu})
      if (busy[q].on && (p < 0 || busy[q].end < busy[p].end)) p = q;
    if (p < 0) throw RunError(std::string("policy ") + policy_name(policy) + " stalled with tasks left");
    now = busy[p].end;
    const Task* t = busy[p].task;
    busy[p].on = false;
    sched.finish(*t);
    records.push_back({t->id, t->chunk, t->step, static_cast<Processor>(p), busy[p].start, now});
  }
  return records;
}

}  // namespace llmnpu
