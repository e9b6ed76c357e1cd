// llmnpu_spin_wait: a worker of the prefill executor waits for the other worker's next hand-off by
// spinning on a counter, with the GIL released (a ctypes call), before it blocks on a condition.
//
// Why: a worker that blocks puts its core to sleep, and on this VM waking one of two pinned threads
// costs 20-50 us (an Event ping-pong), while a spinning one sees the change at once. A 1,024-token
// prefill of the embedded model hands work between the workers ~150 times, many of them on the
// critical path.
// The spin is bounded (the caller passes the budget) and only runs inside a prefill, whose two
// workers own their cores; pthreadpool, which XNNPACK runs on, spins before it sleeps for the same
// reason.
#include <immintrin.h>

#include <chrono>
#include <cstdint>

// Spins until *word != seen or max_ns have passed; returns the last value read.
extern "C" int64_t llmnpu_spin_wait(const int64_t* word, int64_t seen, int64_t max_ns) {
  using clock = std::chrono::steady_clock;
  const auto deadline = clock::now() + std::chrono::nanoseconds(max_ns);
  int64_t value;
  while ((value = __atomic_load_n(word, __ATOMIC_ACQUIRE)) == seen) {
    for (int i = 0; i < 32; ++i) _mm_pause();   // a few hundred ns between reads of the clock
    if (clock::now() >= deadline) break;
  }
  return value;
}
