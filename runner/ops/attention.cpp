// The dispatcher of chunk_attention_f32: the mask's visible key ranges, the scratch, and the vector
// path for this CPU (attention_impl.h compiled once per ISA).
#include "attention.h"

#include <cstdlib>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
#define LLMNPU_NS avx512
#define LLMNPU_W 16
#define LLMNPU_R 6
namespace llmnpu_ops {
#include "attention_impl.h"
}
#undef LLMNPU_NS
#undef LLMNPU_W
#undef LLMNPU_R
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define LLMNPU_NS avx2
#define LLMNPU_W 8
#define LLMNPU_R 3
namespace llmnpu_ops {
#include "attention_impl.h"
}
#undef LLMNPU_NS
#undef LLMNPU_W
#undef LLMNPU_R
#pragma GCC pop_options
#endif

// the baseline: SSE2 on x86-64 (16 registers), NEON on aarch64 (32)
#define LLMNPU_NS baseline
#define LLMNPU_W 4
#if defined(__aarch64__)
#define LLMNPU_R 6
#else
#define LLMNPU_R 3
#endif
namespace llmnpu_ops {
#include "attention_impl.h"
}

namespace llmnpu_ops {
namespace {

enum class Isa { kBaseline, kAvx2, kAvx512 };

// LLMNPU_OPS_ISA=avx2|baseline caps the path (the tests run each one on one machine), and so does
// LLMNPU_CPU_ISA=avx2, the project's knob for an AVX2-only CPU (make test-avx2)
bool capped_at(const char* isa_name) {
  for (const char* var : {"LLMNPU_OPS_ISA", "LLMNPU_CPU_ISA"}) {
    const char* v = std::getenv(var);
    if (v && std::strcmp(v, isa_name) == 0) return true;
  }
  return false;
}

Isa isa() {
  static const Isa chosen = [] {
    if (capped_at("baseline")) return Isa::kBaseline;
#if defined(__x86_64__)
    if (!capped_at("avx2") && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq"))
      return Isa::kAvx512;
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) return Isa::kAvx2;
#endif
    return Isa::kBaseline;
  }();
  return chosen;
}

constexpr int64_t kBlockRows = 48;   // query rows per block: their scores over 1,024 keys stay in L2

}  // namespace

bool chunk_attention_supports(int64_t dim) { return dim > 0 && dim % 16 == 0; }

const char* chunk_attention_isa() {
  switch (isa()) {
    case Isa::kAvx512: return "avx512";
    case Isa::kAvx2: return "avx2";
    default: return "baseline";
  }
}

void chunk_attention_f32(const float* q, const float* k, const float* v, const uint8_t* keep,
                         const float* add, const AttentionShape& s, float scaling, float* out) {
  const int64_t C = s.rows, L = s.keys, d = s.dim, g = s.heads / s.kv_heads;
  // each query's visible keys: [lo, hi), and whether all of them are (one contiguous run)
  thread_local std::vector<int64_t> lo, hi;
  thread_local std::vector<uint8_t> dense;
  lo.assign(C, 0);
  hi.assign(C, 0);
  dense.assign(C, 1);
  for (int64_t c = 0; c < C; ++c) {
    int64_t first = -1, last = -1, seen = 0;
    for (int64_t j = 0; j < L; ++j) {
      const bool visible = keep ? keep[c * L + j] != 0 : add[c * L + j] != -__builtin_inff();
      if (!visible) continue;
      if (first < 0) first = j;
      last = j;
      ++seen;
    }
    if (first < 0) continue;
    lo[c] = first;
    hi[c] = last + 1;
    dense[c] = seen == last + 1 - first;
  }
  const int64_t positions = kBlockRows / g > 0 ? kBlockRows / g : 1;
  const int64_t rows = positions * g;
  const int64_t lp = (L + 63) / 64 * 64;   // the widest strip of any path is 64 floats
  thread_local std::vector<float> kt, qb, sc, ob;
  kt.resize(d * lp);
  qb.resize(rows * d);
  sc.resize(rows * lp);
  ob.resize(rows * d);
  switch (isa()) {
#if defined(__x86_64__)
    case Isa::kAvx512:
      return avx512::attend(q, k, v, keep, add, s, scaling, out, lo.data(), hi.data(), dense.data(), positions,
                            kt.data(), qb.data(), sc.data(), ob.data());
    case Isa::kAvx2:
      return avx2::attend(q, k, v, keep, add, s, scaling, out, lo.data(), hi.data(), dense.data(), positions,
                          kt.data(), qb.data(), sc.data(), ob.data());
#endif
    default:
      return baseline::attend(q, k, v, keep, add, s, scaling, out, lo.data(), hi.data(), dense.data(), positions,
                              kt.data(), qb.data(), sc.data(), ob.data());
  }
}

}  // namespace llmnpu_ops
