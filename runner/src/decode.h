// Decode: the program's decode method on a static K/V cache the runner owns (lower/decode_method.py says
// why): per layer K [1, KVH, d, context] (transposed) and V [1, KVH, context, d], filled once from
// the prefill; each step writes the new token's K/V into its slot.
#pragma once
#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "methods.h"
#include "prefill.h"

namespace llmnpu {

class Decoder {
 public:
  // `release`: drop each layer's prefill K/V once copied (the caller keeps none: the decode cache and
  // the prompt's K/V are never both held whole)
  Decoder(const Sidecar& s, LoadedProgram& program, PrefillResult& prefill, bool release = false);
  // Logits [vocab] of the token after `token`, which goes into slot `length()`.
  std::vector<float> step(int64_t token);
  int64_t length() const { return length_; }

 private:
  const Sidecar& s_;
  executorch::extension::Module& module_;
  std::vector<std::vector<float>> k_, v_;
  int64_t length_ = 0;
};

struct Sampling {
  std::optional<double> temperature;   // none: greedy
  double top_p = 1.0;
  std::mt19937_64 rng{0};
};

// Greedy (the first largest), or a draw at `temperature` from the smallest set of most likely
// tokens whose probabilities reach `top_p` (runtime/sampling.py; a different random stream).
int64_t next_token(const std::vector<float>& logits, Sampling& sampling);

}  // namespace llmnpu
