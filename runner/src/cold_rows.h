// The shadow path's cold rows: the rows of W^T its methods do not multiply densely, in the rows file
// beside the program or in the program's own INT8 weights (format/rows.py's layout), multiplied one
// row per hit channel. Mirrors format/rows.py (ColdRows).
#pragma once
#include <atomic>
#include <cstdint>
#include <map>
#include <vector>
#include <string>

#include "sidecar.h"
#include "value.h"

namespace llmnpu {

// A row is read when an outlier hits its channel and dropped after the product, so the file never
// becomes resident (a mapping would keep every row ever hit in the process's memory: most of the
// file after one long prompt).
class ColdRows {
 public:
  // `dir`: the folder of the rows file; `pte`: the program, for the linears whose rows it holds.
  ColdRows(const Sidecar& s, const std::string& dir, const std::string& pte);
  ~ColdRows();
  ColdRows(const ColdRows&) = delete;
  ColdRows& operator=(const ColdRows&) = delete;
  // Adds (x - clip(x))[:, hit] @ W^T[hit] to `out` for the cold channels that `hits` flags.
  void add_product(const std::string& linear, const Value& x, const Value& hits, Value& out);
  std::atomic<int64_t> fetched{0};   // rows read

 private:
  void open_files(const std::string& dir, const std::string& pte);   // the constructor's work

  const Sidecar& s_;
  int fd_ = -1;           // the rows file
  int program_fd_ = -1;   // the .pte
  std::map<std::string, std::vector<float>> scales_;   // INT8 rows: each linear's, read once
};

// IEEE half to float (exact: every half is a float), `n` of them; the CPU's own conversion where it
// has one (F16C, Arm's FP16), else bit by bit.
void halves_to_floats(const uint16_t* h, float* f, int64_t n);

// INT8 codes to floats, `code * scale` per output channel (format/rows.py's int8 rows).
void codes_to_floats(const int8_t* q, const float* scale, float* f, int64_t n);

// Which conversion and product loops this CPU takes ("f16c+avx2", ...; "baseline" under
// LLMNPU_RUNNER_BASELINE=1): the --json summary reports it
std::string cold_kernels();

}  // namespace llmnpu
