// llmnpu_spin_wait and lane help (lane_help.h).
//
// A worker of the prefill executor waits for the other worker's next hand-off by spinning on a
// counter, with the GIL released (a ctypes call), before it blocks on a condition. Why: a worker that
// blocks puts its core to sleep, and on these VMs waking one of two pinned threads costs 20-50 us (an
// Event ping-pong), while a spinning one sees the change at once; a 1,024-token prefill of the
// embedded model hands work between the workers ~150 times, many on the critical path. The spin is
// bounded (the caller passes the budget) and only runs inside a prefill, whose two workers own their
// cores; pthreadpool, which XNNPACK runs on, spins before it sleeps for the same reason.
//
// With help=1 the spinning worker also runs pieces of a `shared_for` in flight (see lane_help.h), and
// leaves it between two pieces once the word it waits on changes.
#include "lane_help.h"

#include <atomic>
#include <chrono>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

inline void cpu_pause() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// One job at a time. The owner publishes it (`open`), helpers enter (`inside`) and claim pieces from
// `next`; the owner closes it and waits until no helper is inside before the job's storage (its
// stack) goes away, so a helper never touches a finished job.
struct Slot {
  std::atomic<bool> owned{false};
  std::atomic<bool> open{false};
  std::atomic<int> inside{0};
  const std::function<void(int64_t)>* body = nullptr;
  int64_t count = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> helped{0};    // pieces run by helpers since load (llmnpu_pieces_helped)
};
Slot slot;

// Claims and runs pieces until none is left, or (a helper) until *word != seen: the helper's own next
// task is ready, and the owner runs what is left.
int64_t run_pieces(const int64_t* word = nullptr, int64_t seen = 0) {
  int64_t ran = 0;
  while (word == nullptr || __atomic_load_n(word, __ATOMIC_ACQUIRE) == seen) {
    const int64_t i = slot.next.fetch_add(1);
    if (i >= slot.count) break;
    (*slot.body)(i);
    ++ran;
  }
  return ran;
}

// A waiting helper: run what is left of the open job, if any, while *word == seen. Returns whether
// there was one.
bool help_once(const int64_t* word, int64_t seen) {
  if (!slot.open.load()) return false;
  slot.inside.fetch_add(1);
  const bool open = slot.open.load();     // re-read inside: the owner waits for us from here on
  if (open) slot.helped.fetch_add(run_pieces(word, seen), std::memory_order_relaxed);
  slot.inside.fetch_sub(1);
  return open;
}

}  // namespace

namespace llmnpu {

void shared_for(int64_t count, const std::function<void(int64_t)>& body) {
  // open even without a helper waiting now: a worker that turns idle in the middle joins then
  if (count <= 1 || slot.owned.exchange(true)) {
    for (int64_t i = 0; i < count; ++i) body(i);
    return;
  }
  slot.body = &body;
  slot.count = count;
  slot.next.store(0);
  slot.open.store(true);
  run_pieces();
  slot.open.store(false);
  while (slot.inside.load() != 0) cpu_pause();   // a helper finishing its last piece
  slot.owned.store(false);
}

}  // namespace llmnpu

// Spins until *word != seen or max_ns have passed; returns the last value read. With help != 0 it
// runs pieces of any shared_for in flight meanwhile (a piece started before the deadline finishes).
extern "C" int64_t llmnpu_spin_wait(const int64_t* word, int64_t seen, int64_t max_ns, int help) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::nanoseconds(max_ns);
  int64_t value;
  while ((value = __atomic_load_n(word, __ATOMIC_ACQUIRE)) == seen) {
    if (help && help_once(word, seen)) continue;
    for (int i = 0; i < 32; ++i) cpu_pause();   // a few hundred ns between reads of the clock
    if (clock::now() >= deadline) break;
  }
  return value;
}

// How many pieces helpers have run since the library was loaded (what the executor reports as lent work).
extern "C" int64_t llmnpu_pieces_helped() { return slot.helped.load(std::memory_order_relaxed); }
