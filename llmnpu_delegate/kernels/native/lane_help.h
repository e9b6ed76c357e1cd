// Lane help: the prefill executor's idle CPU worker lends its core to the stand-in NPU's kernels.
//
// On a phone the NPU is its own hardware. Here both lanes are CPU cores, and whenever one lane has no
// ready task its core would sit idle while the other lane is the critical path: the CPU lane waits
// for the NPU's Q/K/V early in a prefill and at the last chunk's tail; the NPU lane waits for
// attention when a later turn's few chunks attend over a long past. So the native INT8 kernels and the
// bf16 attention split their work into independent pieces with `shared_for`; the idle worker, which
// waits for its next task in `llmnpu_spin_wait(..., help=1)`, takes pieces while it waits and leaves
// between two pieces when its own next task is ready. Results do not change: every piece computes
// the same outputs whichever thread runs it.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <functional>

namespace llmnpu {

// Runs body(i) for every i in [0, count), on this thread and on any helper that waits meanwhile (one
// may join at any piece), and returns when all have run. While another shared_for runs, all run here,
// in order. body must not throw.
void shared_for(int64_t count, const std::function<void(int64_t)>& body);

// fn(begin, end) over [0, n) in grains of `grain`: across torch's threads when it has several (as
// at::parallel_for), else as pieces of a shared_for.
inline void parallel_pieces(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)>& fn) {
  if (n <= 0) return;
  if (at::get_num_threads() > 1) {
    at::parallel_for(0, n, grain, fn);
    return;
  }
  grain = std::max<int64_t>(grain, 1);
  shared_for((n + grain - 1) / grain, [&](int64_t i) { fn(i * grain, std::min(n, (i + 1) * grain)); });
}

}  // namespace llmnpu
