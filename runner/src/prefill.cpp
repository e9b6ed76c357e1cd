#include "prefill.h"

#include <chrono>
#include <condition_variable>
#include <exception>
#include <map>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>

#include <executorch/extension/threadpool/threadpool_guard.h>

#include "error.h"

namespace llmnpu {
namespace {

using Clock = std::chrono::steady_clock;
using Env = std::unordered_map<std::string, ValuePtr>;

// Per chunk: ids (the last chunk padded with 0), positions, the row whose logits are wanted; the
// first chunk also gets the past K/V, empty or `past`, whose tokens come before the prompt's
// (runtime/prompt.py chunk_feeds).
std::vector<Env> chunk_feeds(const Sidecar& s, const std::vector<int64_t>& ids, const Past* past) {
  const int64_t c = s.chunk_len, n = static_cast<int64_t>(ids.size());
  const int64_t p0 = past ? past->length() : 0;
  std::vector<Env> feeds;
  for (int64_t start = 0; start < n; start += c) {
    const int64_t part = std::min(c, n - start);
    auto input = Value::make(ScalarType::Long, {1, c});
    auto pos = Value::make(ScalarType::Long, {c});
    auto index = Value::make(ScalarType::Long, {1});
    for (int64_t i = 0; i < c; ++i) {
      input->i64()[i] = i < part ? ids[start + i] : 0;
      pos->i64()[i] = p0 + start + i;
    }
    index->i64()[0] = part - 1;
    feeds.push_back({{"input_ids", input}, {"cache_position", pos}, {"logits_index", index}});
  }
  ValuePtr empty = Value::make(ScalarType::Float, {1, s.kv_heads, 0, s.head_dim});
  for (int64_t l = 0; l < s.layers; ++l) {
    feeds[0][past_name("k", l)] = past ? past->k.at(l) : empty;
    feeds[0][past_name("v", l)] = past ? past->v.at(l) : empty;
  }
  return feeds;
}

// [1, H, T, d] -> its first `t` positions
ValuePtr cut(const Value& kv, int64_t t) {
  const int64_t h = kv.shape[1], total = kv.shape[2], d = kv.shape[3];
  auto out = Value::make(ScalarType::Float, {1, h, t, d});
  for (int64_t i = 0; i < h; ++i)
    std::memcpy(out->f32() + i * t * d, kv.f32() + i * total * d, static_cast<size_t>(t * d) * 4);
  return out;
}

// `kv` cut to its first `t` positions, in place when nothing else holds it
ValuePtr shrink(ValuePtr kv, int64_t t) {
  if (kv.use_count() != 1) return cut(*kv, t);
  auto& v = const_cast<Value&>(*kv);   // sole owner: no reader can see the change
  const int64_t h = v.shape[1], total = v.shape[2], d = v.shape[3];
  for (int64_t i = 1; i < h; ++i)        // head i moves down to i * t * d <= i * total * d
    std::memmove(v.f32() + i * t * d, v.f32() + i * total * d, static_cast<size_t>(t * d) * 4);
  v.shape[2] = t;
  v.bytes.resize(static_cast<size_t>(h * t * d) * 4 + 1);   // the spare byte of Value::make
  return kv;
}

}  // namespace

Past first_tokens(const std::vector<ValuePtr>& k, const std::vector<ValuePtr>& v, int64_t t) {
  Past past;
  for (size_t l = 0; l < k.size(); ++l) {
    past.k.push_back(cut(*k[l], t));
    past.v.push_back(cut(*v[l], t));
  }
  return past;
}

PrefillResult prefill(const Sidecar& s, LoadedProgram& program, const std::vector<int64_t>& ids, Policy policy,
                      std::optional<std::pair<int, int>> fail_at, const Past* past) {
  if (program.prefill_released()) throw RunError("the prefill's methods were released: load the program again");
  std::vector<Env> envs = chunk_feeds(s, ids, past);
  const int chunks = static_cast<int>(envs.size());
  const int64_t reused = past ? past->length() : 0;
  if (!s.has_profile && uses_costs(policy)) policy = Policy::kInorder;   // nothing to score with
  std::vector<Task> tasks = expand(s, chunks, static_cast<double>(reused) / static_cast<double>(s.chunk_len));
  Scheduler sched(tasks, policy);

  // a value is dropped once its last reader of the chunk has run, unless the result needs it
  std::vector<std::unordered_map<std::string, int>> uses(chunks);
  for (const auto& t : tasks)
    for (const auto& name : s.subgraphs[t.step].inputs) ++uses[t.chunk][name];
  std::set<std::string> keep(s.graph_outputs.begin(), s.graph_outputs.end());
  std::unordered_map<std::string, std::string> handoff;   // chunk i's K/V output -> chunk i+1's past input
  for (int64_t l = 0; l < s.layers; ++l) {
    handoff[s.graph_outputs[1 + l]] = past_name("k", l);
    handoff[s.graph_outputs[1 + s.layers + l]] = past_name("v", l);
  }

  PrefillResult result;
  result.chunks = chunks;
  std::mutex mu;
  std::condition_variable cv;
  std::string error;
  const auto t0 = Clock::now();
  auto seconds = [t0](Clock::time_point t) { return std::chrono::duration<double>(t - t0).count(); };

  auto work = [&](Processor p) {
    // one core per worker: kernels that parallelize through ExecuTorch's shared pool (its threads
    // spin while waiting) would contend with the other worker
    executorch::extension::threadpool::NoThreadPoolGuard single;
    std::unique_lock<std::mutex> lock(mu);
    while (true) {
      const Task* task = nullptr;
      while (true) {
        if (!error.empty() || sched.finished()) {
          cv.notify_all();
          return;
        }
        const auto d0 = Clock::now();
        task = sched.pick(p);
        result.decision_s += std::chrono::duration<double>(Clock::now() - d0).count();
        ++result.decisions;
        if (task) break;
        cv.wait(lock);
      }
      const Subgraph& sub = s.subgraphs[task->step];
      std::vector<ValuePtr> args;
      std::string missing;
      for (const auto& name : sub.inputs) {
        auto it = envs[task->chunk].find(name);
        if (it == envs[task->chunk].end()) missing = name;
        args.push_back(it == envs[task->chunk].end() ? nullptr : it->second);
      }
      lock.unlock();
      const auto start = Clock::now();
      std::vector<ValuePtr> outs;
      std::string failure;
      try {
        if (!missing.empty()) throw RunError("its input " + missing + " was never produced");
        const bool broken = fail_at && fail_at->first == task->chunk && fail_at->second == task->step;
        outs = program.calls[task->step](args, broken);
        if (outs.size() != sub.outputs.size()) throw RunError("it returned the wrong number of outputs");
      } catch (const std::exception& e) {
        failure = e.what();
      }
      const auto end = Clock::now();
      lock.lock();
      if (!failure.empty()) {
        if (error.empty())
          error = "prefill task failed: chunk " + std::to_string(task->chunk) + ", subgraph " +
                  std::to_string(task->step) + " (method " + sub.method + " on " + kProcessorNames[p] + ", " +
                  (sub.layer ? "layer " + std::to_string(*sub.layer) : std::string("model")) + "): " + failure;
        cv.notify_all();
        return;
      }
      result.records.push_back({task->id, task->chunk, task->step, p, seconds(start), seconds(end)});
      Env& env = envs[task->chunk];
      const bool last_chunk = task->chunk + 1 == chunks;
      for (size_t i = 0; i < outs.size(); ++i) {
        // an earlier chunk's K/V live on as the next chunk's past only: holding every chunk's
        // (each one longer than the last) would keep the whole prompt's K/V several times over
        if (uses[task->chunk].count(sub.outputs[i]) || (last_chunk && keep.count(sub.outputs[i])))
          env[sub.outputs[i]] = outs[i];
        auto h = handoff.find(sub.outputs[i]);
        if (h != handoff.end() && !last_chunk) envs[task->chunk + 1][h->second] = outs[i];
      }
      for (const auto& name : sub.inputs)
        if (--uses[task->chunk][name] == 0 && !(last_chunk && keep.count(name))) env.erase(name);
      sched.finish(*task);
      cv.notify_all();
    }
  };

  std::thread npu(work, kNpu), cpu(work, kCpu);
  npu.join();
  cpu.join();
  result.wall_s = seconds(Clock::now());
  if (!error.empty()) throw RunError(error);

  // The last chunk's K/V (padded to whole chunks) are cut to the prompt's tokens in place: copies of
  // all of them beside the originals were the run's peak.
  Env last = std::move(envs.back());
  envs.clear();
  auto take = [&last](const std::string& name) {
    auto it = last.find(name);
    if (it == last.end()) throw RunError("the prefill never produced its output " + name);
    ValuePtr v = std::move(it->second);
    last.erase(it);
    return v;
  };
  const int64_t total = reused + static_cast<int64_t>(ids.size());
  const ValuePtr logits = take(s.graph_outputs[0]);
  result.logits.assign(logits->f32(), logits->f32() + logits->numel());
  for (int64_t l = 0; l < s.layers; ++l) result.k.push_back(shrink(take(s.graph_outputs[1 + l]), total));
  for (int64_t l = 0; l < s.layers; ++l) result.v.push_back(shrink(take(s.graph_outputs[1 + s.layers + l]), total));
  return result;
}

}  // namespace llmnpu
