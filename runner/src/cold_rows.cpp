#include "cold_rows.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "error.h"

namespace llmnpu {

namespace {

// Bit by bit, as numpy converts (the Python runner's rows)
float half_to_float(uint16_t h) {
  uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);                  // inf, nan
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);          // normal: rebias 15 -> 127
  } else if (mant == 0) {
    bits = sign;                                                // zero
  } else {                                                      // subnormal: normalize
    int e = 113;
    while (!(mant & 0x400u)) {
      mant <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((mant & 0x3ffu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

#if defined(__x86_64__)
__attribute__((target("avx,f16c"))) void halves_f16c(const uint16_t* h, float* f, int64_t n) {
  int64_t j = 0;
  for (; j + 8 <= n; j += 8)
    _mm256_storeu_ps(f + j, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + j))));
  for (; j < n; ++j) f[j] = half_to_float(h[j]);
}

// dst += a * row over n floats, without FMA (the same roundings as a multiply then an add, as on
// every other path); the AVX2 clone when the CPU has it (the runner is built for baseline x86-64)
__attribute__((target("avx2"))) void axpy_avx2(float* __restrict dst, float a, const float* __restrict row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += a * row[j];
}
#endif

void axpy_baseline(float* __restrict dst, float a, const float* __restrict row, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += a * row[j];
}

void add(float* __restrict dst, const float* __restrict src, int64_t n) {
  for (int64_t j = 0; j < n; ++j) dst[j] += src[j];
}

// LLMNPU_RUNNER_BASELINE=1 takes the portable loops on any CPU (the tests compare the two)
bool baseline_only() {
  static const bool on = [] {
    const char* v = std::getenv("LLMNPU_RUNNER_BASELINE");
    return v != nullptr && std::string(v) == "1";
  }();
  return on;
}

#if defined(__x86_64__)
bool has_f16c() {
  static const bool yes = !baseline_only() && __builtin_cpu_supports("f16c");
  return yes;
}

bool has_avx2() {
  static const bool yes = !baseline_only() && __builtin_cpu_supports("avx2");
  return yes;
}
#endif

void axpy(float* dst, float a, const float* row, int64_t n) {
#if defined(__x86_64__)
  if (has_avx2()) return axpy_avx2(dst, a, row, n);
#endif
  axpy_baseline(dst, a, row, n);
}

}  // namespace

std::string cold_kernels() {
#if defined(__x86_64__)
  return std::string(has_f16c() ? "f16c" : "baseline") + "+" + (has_avx2() ? "avx2" : "baseline");
#elif defined(__aarch64__)
  return baseline_only() ? "baseline" : "fcvt+baseline";
#else
  return "baseline";
#endif
}

void halves_to_floats(const uint16_t* h, float* f, int64_t n) {
#if defined(__x86_64__)
  if (has_f16c()) return halves_f16c(h, f, n);
#elif defined(__aarch64__)
  if (!baseline_only()) {
    for (int64_t j = 0; j < n; ++j) {   // Armv8's own conversion (FCVT)
      __fp16 v;
      std::memcpy(&v, h + j, sizeof v);
      f[j] = static_cast<float>(v);
    }
    return;
  }
#endif
  for (int64_t j = 0; j < n; ++j) f[j] = half_to_float(h[j]);
}

void codes_to_floats(const int8_t* q, const float* scale, float* f, int64_t n) {
  for (int64_t j = 0; j < n; ++j) f[j] = static_cast<float>(q[j]) * scale[j];   // one rounding, as numpy's
}

namespace {

// Opens `path` read-only and returns its descriptor and size; throws InputError(`missing`) if it cannot.
int open_sized(const std::string& path, const std::string& missing, int64_t& size) {
  int fd = open(path.c_str(), O_RDONLY);
  if (fd < 0) throw InputError(missing);
  struct stat st;
  if (fstat(fd, &st) != 0) {
    close(fd);
    throw InputError(missing);
  }
  size = static_cast<int64_t>(st.st_size);
  return fd;
}

}  // namespace

ColdRows::ColdRows(const Sidecar& s, const std::string& dir, const std::string& pte) : s_(s) {
  if (s.shadow_form != "sparse") return;
  try {
    open_files(dir, pte);
  } catch (...) {   // a constructor that throws runs no destructor: close what was opened
    if (fd_ >= 0) close(fd_);
    if (program_fd_ >= 0) close(program_fd_);
    throw;
  }
}

void ColdRows::open_files(const std::string& dir, const std::string& pte) {
  const Sidecar& s = s_;
  int64_t rows_size = 0, pte_size = 0;
  if (!s.rows_file.empty() && s.rows_bytes > 0) {
    const std::string path = dir + "/" + s.rows_file;
    fd_ = open_sized(path, "the program's cold rows file " + s.rows_file + " is missing: copy it with the .pte", rows_size);
    if (rows_size != s.rows_bytes) throw InputError(path + " does not belong to this program (its size differs): export again");
  }
  for (const auto& [name, c] : s.cold)
    if (c.in_program && program_fd_ < 0) program_fd_ = open_sized(pte, "cannot open " + pte, pte_size);
  for (const auto& [name, c] : s.cold) {
    // the program holds a row for every input channel; the rows file one per cold channel
    const int64_t rows = c.in_program ? c.in_features : static_cast<int64_t>(c.cold_channels.size());
    const int64_t size = c.in_program ? pte_size : rows_size;
    const std::string& where = c.in_program ? pte : s.rows_file;
    const int64_t end = c.rows_offset + rows * c.out_features * s.rows_itemsize;
    const bool scaled = s.rows_itemsize == 1;
    const int64_t scales_end = c.scales_offset + 4 * c.out_features;
    if (c.rows_offset < 0 || c.rows_offset % s.rows_itemsize || end > size ||
        (scaled && (c.scales_offset < 0 || c.scales_offset % 4 || scales_end > size)))
      throw InputError("the sidecar's cold rows of " + name + " lie outside " + where + ": export again");
    if (scaled) {   // little-endian float32, as the hosts this runs on (x86-64, aarch64 Linux/Android)
      std::vector<float> scales(static_cast<size_t>(c.out_features));
      const auto bytes = static_cast<ssize_t>(scales.size() * sizeof(float));
      if (pread(c.in_program ? program_fd_ : fd_, scales.data(), static_cast<size_t>(bytes),
                static_cast<off_t>(c.scales_offset)) != bytes)
        throw InputError("cannot read the cold rows' scales of " + name + " from " + where + ": export again");
      scales_[name] = std::move(scales);
    }
  }
}

ColdRows::~ColdRows() {
  if (fd_ >= 0) close(fd_);
  if (program_fd_ >= 0) close(program_fd_);
}

void ColdRows::add_product(const std::string& linear, const Value& x, const Value& hits, Value& out) {
  const ColdLinear& c = s_.cold.at(linear);
  const int64_t k = c.in_features, n = c.out_features, m = x.numel() / k;
  if (x.shape.empty() || x.shape.back() != k || hits.numel() != k || out.numel() != m * n)
    throw RunError("shadow branch of " + linear + ": unexpected shapes");
  const float* h = hits.f32();
  std::vector<int64_t> channels;   // the cold channels hit, ascending
  std::vector<float> rows;         // their rows of W^T, [channels, n]
  std::vector<uint16_t> half(s_.rows_itemsize == 2 ? static_cast<size_t>(n) : 0);
  std::vector<int8_t> codes(s_.rows_itemsize == 1 ? static_cast<size_t>(n) : 0);
  const float* scales = codes.empty() ? nullptr : scales_.at(linear).data();
  const int64_t row_bytes = n * s_.rows_itemsize;
  for (size_t slot = 0; slot < c.cold_channels.size(); ++slot) {
    const int64_t ch = c.cold_channels[slot];
    if (!(h[ch] > 0)) continue;
    channels.push_back(ch);
    rows.resize(channels.size() * static_cast<size_t>(n));
    float* row = rows.data() + (channels.size() - 1) * n;
    const int64_t index = c.in_program ? ch : static_cast<int64_t>(slot);
    const off_t at = static_cast<off_t>(c.rows_offset + index * row_bytes);
    void* dst = !half.empty() ? static_cast<void*>(half.data()) : !codes.empty() ? static_cast<void*>(codes.data())
                                                                                 : static_cast<void*>(row);
    if (pread(c.in_program ? program_fd_ : fd_, dst, static_cast<size_t>(row_bytes), at) != static_cast<ssize_t>(row_bytes))
      throw RunError("cannot read the cold rows of " + linear + (c.in_program ? " from the program" : " from " + s_.rows_file));
    if (!half.empty()) halves_to_floats(half.data(), row, n);
    if (!codes.empty()) codes_to_floats(codes.data(), scales, row, n);
  }
  if (channels.empty()) return;
  fetched.fetch_add(static_cast<int64_t>(channels.size()), std::memory_order_relaxed);
  // Row by row: the channels' products summed apart in one row of scratch, then added (the Python
  // runner's order: delta + cold product)
  const float clip = static_cast<float>(c.clip);
  const float* xs = x.f32();
  float* y = out.f32();
  std::vector<float> sum(static_cast<size_t>(n));
  for (int64_t r = 0; r < m; ++r) {
    bool any = false;
    for (size_t i = 0; i < channels.size(); ++i) {
      const float v = xs[r * k + channels[i]];
      const float residue = v - std::min(std::max(v, -clip), clip);
      if (residue == 0.0f) continue;
      if (!any) std::fill(sum.begin(), sum.end(), 0.0f);
      any = true;
      axpy(sum.data(), residue, rows.data() + i * n, n);
    }
    if (any) add(y + r * n, sum.data(), n);
  }
}

}  // namespace llmnpu
