// llmnpu_native.Int8Gemv: decode's dynamic INT8 linear, exact in 8 bits on every CPU.
//
// Decode multiplies one token (M = 1) by every weight, so it is bound by reading the weights: they
// stay one byte each (int8_gemm.cpp widens them to int16, which suits prefill's large M, not this).
// The token is quantized with its own range to u8 codes with a zero point, as fbgemm's dynamic linear
// does, but fbgemm (and oneDNN) multiply u8 x s8 with vpmaddubsw where the CPU has no VNNI, which
// adds two products into a saturating int16 (255 * 127 * 2 > 32767). Here:
// - vnni: vpdpbusd sums four u8 x s8 products straight into int32;
// - avx2: x - 128 is an s8 code c with |c| <= 128, and vpmaddubsw(|c|, sign(w, c)) adds two products of
//   at most 128 * 127 = 16256 each: 32512 fits int16 (weights are symmetric, never -128). The sum over
//   x is then sum c W + 128 * sum W;
// - portable: plain loops (aarch64 and anything else).
// Every variant is compiled with its own target attribute into one library (kernels/int8_path.py
// chooses); the float epilogue is done in double exactly as ops.dynamic_linear_reference does it.
#include "int8_gemv.h"

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace llmnpu {
namespace {

constexpr int64_t PANEL = 8;   // output columns per 32-byte vector (8 x 4 k)
constexpr int64_t GROUP = 4;   // k per column per vector
constexpr int64_t QUAD = 4;    // panels per step of the x86 loops: the packed panels are padded to it
enum Isa { PORTABLE = 0, AVX2 = 1, VNNI = 2 };

int parse_path(const std::string& name) {
  if (name == "vnni") return VNNI;
  if (name == "avx2") return AVX2;
  TORCH_CHECK(name == "portable", "Int8Gemv: unknown path '", name, "' (vnni, avx2 or portable)");
  return PORTABLE;
}

bool supported(int isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == AVX2) return __builtin_cpu_supports("avx2");
  if (isa == VNNI) return __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl");
  return true;
#else
  return isa == PORTABLE;
#endif
}

// out[n] = sum_k x[k] * W[n, k] for the panels [p0, p1); x padded to `groups` * 4 bytes with zeros,
// whose weights are zeros too (avx2 reads x as the s8 codes c = x - 128).
void panels_portable(const uint8_t* x, const int8_t* w, int64_t groups, int64_t p0, int64_t p1, int32_t* out) {
  for (int64_t p = p0; p < p1; ++p) {
    int32_t acc[PANEL] = {0};
    const int8_t* wp = w + p * groups * PANEL * GROUP;
    for (int64_t g = 0; g < groups; ++g) {
      for (int64_t j = 0; j < PANEL; ++j) {
        for (int64_t i = 0; i < GROUP; ++i) acc[j] += int32_t{x[g * GROUP + i]} * wp[(g * PANEL + j) * GROUP + i];
      }
    }
    std::copy(acc, acc + PANEL, out + p * PANEL);
  }
}

#if defined(__x86_64__)
// Four panels at a time, so that each broadcast of x feeds four multiplies (the packed weight holds a
// multiple of four panels, zeros past N, and p0, p1 are multiples of four).
__attribute__((target("avx2"))) void panels_avx2(const uint8_t* c, const int8_t* w, int64_t groups, int64_t p0,
                                                 int64_t p1, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  const int64_t stride = groups * 32;
  for (int64_t p = p0; p < p1; p += QUAD) {
    const int8_t* w0 = w + p * stride;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t four;
      std::memcpy(&four, c + g * GROUP, 4);
      const __m256i xc = _mm256_set1_epi32(four);
      const __m256i ax = _mm256_abs_epi8(xc);
#define LLMNPU_STEP(acc, q)                                                                          \
  {                                                                                                  \
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + (q) * stride + g * 32)); \
    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xc)), ones)); \
  }
      LLMNPU_STEP(a0, 0) LLMNPU_STEP(a1, 1) LLMNPU_STEP(a2, 2) LLMNPU_STEP(a3, 3)
#undef LLMNPU_STEP
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * PANEL), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 1) * PANEL), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 2) * PANEL), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 3) * PANEL), a3);
  }
}

__attribute__((target("avx2,avx512f,avx512vl,avx512vnni"))) void panels_vnni(const uint8_t* x, const int8_t* w,
                                                                             int64_t groups, int64_t p0, int64_t p1,
                                                                             int32_t* out) {
  const int64_t stride = groups * 32;
  for (int64_t p = p0; p < p1; p += QUAD) {
    const int8_t* w0 = w + p * stride;
    __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t g = 0; g < groups; ++g) {
      int32_t four;
      std::memcpy(&four, x + g * GROUP, 4);
      const __m256i xv = _mm256_set1_epi32(four);
#define LLMNPU_STEP(acc, q) \
  acc = _mm256_dpbusd_epi32(acc, xv, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0 + (q) * stride + g * 32)));
      LLMNPU_STEP(a0, 0) LLMNPU_STEP(a1, 1) LLMNPU_STEP(a2, 2) LLMNPU_STEP(a3, 3)
#undef LLMNPU_STEP
    }
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + p * PANEL), a0);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 1) * PANEL), a1);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 2) * PANEL), a2);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (p + 3) * PANEL), a3);
  }
}
#endif

}  // namespace

Int8Gemv::Int8Gemv(const at::Tensor& w_q, const at::Tensor& w_scale, const std::optional<at::Tensor>& bias,
                   const std::string& path)
    : path_(path), isa_(parse_path(path)) {
  TORCH_CHECK(supported(isa_), "Int8Gemv: this CPU cannot run the ", path, " path");
  TORCH_CHECK(w_q.dim() == 2 && w_q.scalar_type() == at::kChar, "Int8Gemv: w_q must be int8 [N, K]");
  TORCH_CHECK(w_scale.scalar_type() == at::kFloat && w_scale.numel() == w_q.size(0),
              "Int8Gemv: w_scale must be float32 with one entry per output channel");
  const at::Tensor wc = w_q.contiguous();
  n = wc.size(0);
  k = wc.size(1);
  const int64_t panels = (n + PANEL * QUAD - 1) / (PANEL * QUAD) * QUAD, groups = (k + GROUP - 1) / GROUP;
  packed_ = at::zeros({panels, groups, PANEL, GROUP}, wc.options());
  colsum_ = at::zeros({n}, wc.options().dtype(at::kInt));
  const int8_t* src = wc.const_data_ptr<int8_t>();
  int8_t* dst = packed_.data_ptr<int8_t>();
  int32_t* cs = colsum_.data_ptr<int32_t>();
  for (int64_t r = 0; r < n; ++r) {
    const int64_t panel = r / PANEL, lane = r % PANEL;
    for (int64_t c = 0; c < k; ++c) {
      const int8_t v = src[r * k + c];
      TORCH_CHECK(v != -128, "Int8Gemv: weight codes must be symmetric (-127..127), found -128");
      dst[((panel * groups + c / GROUP) * PANEL + lane) * GROUP + c % GROUP] = v;
      cs[r] += v;
    }
  }
  w_scale_ = w_scale.contiguous();
  if (bias.has_value() && bias->defined() && bias->numel() > 0) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "Int8Gemv: bias must be float32 [N]");
    bias_ = bias->contiguous();
  }
}

void Int8Gemv::accumulate_into(const uint8_t* x, int64_t m, int32_t* out) const {
  const int64_t panels = packed_.size(0), groups = packed_.size(1), quads = panels / QUAD;
  const int8_t* w = packed_.const_data_ptr<int8_t>();
  // tasks of >= 64 KiB of weights each: a small linear stays on one thread
  const int64_t grain = std::max<int64_t>(1, 65536 / (groups * 32 * QUAD));
  std::vector<uint8_t> row(static_cast<size_t>(groups * GROUP));
  std::vector<int32_t> acc(static_cast<size_t>(panels * PANEL));
  const int32_t* cs = colsum_.const_data_ptr<int32_t>();
  for (int64_t r = 0; r < m; ++r) {
    const uint8_t* xr = x + r * k;
    if (isa_ == AVX2) {   // c = x - 128 as s8 bytes; padding c = 0
      std::fill(row.begin(), row.end(), uint8_t{0});
      for (int64_t i = 0; i < k; ++i) row[i] = static_cast<uint8_t>(xr[i] ^ 0x80);
    } else {
      std::fill(row.begin(), row.end(), uint8_t{0});
      std::copy(xr, xr + k, row.begin());
    }
    at::parallel_for(0, quads, grain, [&](int64_t q0, int64_t q1) {
      const int64_t p0 = q0 * QUAD, p1 = q1 * QUAD;
#if defined(__x86_64__)
      if (isa_ == AVX2) return panels_avx2(row.data(), w, groups, p0, p1, acc.data());
      if (isa_ == VNNI) return panels_vnni(row.data(), w, groups, p0, p1, acc.data());
#endif
      panels_portable(row.data(), w, groups, p0, p1, acc.data());
    });
    int32_t* o = out + r * n;
    for (int64_t j = 0; j < n; ++j) o[j] = isa_ == AVX2 ? acc[j] + 128 * cs[j] : acc[j];
  }
}

at::Tensor Int8Gemv::accumulate(const at::Tensor& x_u8) const {
  TORCH_CHECK(x_u8.dim() == 2 && x_u8.scalar_type() == at::kByte && x_u8.size(1) == k,
              "Int8Gemv.accumulate: x must be uint8 [M, ", k, "]");
  const at::Tensor xc = x_u8.contiguous();
  at::Tensor out = at::empty({xc.size(0), n}, xc.options().dtype(at::kInt));
  accumulate_into(xc.const_data_ptr<uint8_t>(), xc.size(0), out.data_ptr<int32_t>());
  return out;
}

at::Tensor Int8Gemv::forward(const at::Tensor& x) const {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) == k,
              "Int8Gemv: x must be float32 [M, ", k, "]");
  const at::Tensor xc = x.contiguous();
  const int64_t m = xc.size(0), total = xc.numel();
  const float* xp = xc.const_data_ptr<float>();
  float lo_f = 0.0f, hi_f = 0.0f;   // the range always holds 0, so 0 has a code
  for (int64_t i = 0; i < total; ++i) {
    lo_f = std::min(lo_f, xp[i]);
    hi_f = std::max(hi_f, xp[i]);
  }
  const double lo = lo_f, hi = hi_f;
  double scale = (hi - lo) / 255.0;
  if (scale == 0.0) scale = 1.0;
  const double zero = std::min(std::max(std::nearbyint(-lo / scale), 0.0), 255.0);
  std::vector<uint8_t> q(static_cast<size_t>(total));
  for (int64_t i = 0; i < total; ++i) {
    const double v = std::nearbyint(static_cast<double>(xp[i]) / scale) + zero;
    q[i] = static_cast<uint8_t>(v >= 255.0 ? 255.0 : v >= 0.0 ? v : 0.0);   // a NaN becomes code 0, never UB
  }
  std::vector<int32_t> acc(static_cast<size_t>(m * n));
  accumulate_into(q.data(), m, acc.data());
  at::Tensor out = at::empty({m, n}, xc.options());
  float* o = out.data_ptr<float>();
  const int32_t* cs = colsum_.const_data_ptr<int32_t>();
  const float* ws = w_scale_.const_data_ptr<float>();
  const float* b = bias_.defined() ? bias_.const_data_ptr<float>() : nullptr;
  const int64_t z = static_cast<int64_t>(zero);
  for (int64_t r = 0; r < m; ++r) {
    for (int64_t j = 0; j < n; ++j) {
      const int64_t a = static_cast<int64_t>(acc[r * n + j]) - z * cs[j];
      const double v = static_cast<double>(a) * (scale * static_cast<double>(ws[j]));
      o[r * n + j] = static_cast<float>(b ? v + static_cast<double>(b[j]) : v);
    }
  }
  return out;
}

namespace {
bool int8_gemv_supported(const std::string& path) { return supported(parse_path(path)); }

// the call as an operator, so the profiler names it (tests/test_decode.py counts the decode's linears)
at::Tensor int8_gemv(const c10::intrusive_ptr<Int8Gemv>& gemv, const at::Tensor& x) { return gemv->forward(x); }
}  // namespace

}  // namespace llmnpu

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.class_<llmnpu::Int8Gemv>("Int8Gemv")
      .def(torch::init<at::Tensor, at::Tensor, std::optional<at::Tensor>, std::string>())
      .def("forward", &llmnpu::Int8Gemv::forward)
      .def("accumulate", &llmnpu::Int8Gemv::accumulate)
      .def("path", &llmnpu::Int8Gemv::path_name);
  m.def("int8_gemv_supported(str path) -> bool", &llmnpu::int8_gemv_supported);
  m.def("int8_gemv(__torch__.torch.classes.llmnpu_native.Int8Gemv gemv, Tensor x) -> Tensor", &llmnpu::int8_gemv);
}
