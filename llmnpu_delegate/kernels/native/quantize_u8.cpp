// llmnpu_native::quantize_u8: an NPU subgraph's input quantization, clamp(round(x / scale), -127, 127)
// + 128 as uint8 (oneDNN's u8 activation), in one pass and bit for bit as the torch ops compute it
// (true division, round half to even).
//
// It replaced an inductor-compiled kernel of the same expression, equally fast, because inductor's
// kernels run with the GIL held: the 30-140 us of each NPU task's quantization kept the float
// worker from resuming, and every hand-off from the INT8 worker to the float one waited for it
// (median 128 us notify to wake, measured). Torch operators release the GIL.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lane_help.h"

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

inline uint8_t quantize_one(float x, float scale) {
  const float q = std::nearbyint(x / scale);                     // the default rounding: half to even
  return static_cast<uint8_t>(static_cast<int32_t>(std::fmin(std::fmax(q, -127.0f), 127.0f)) + 128);
}

// The vector paths multiply by 1/scale, which rounds twice (~2^-23 relative) where x / scale rounds
// once: the nearest integer can differ only where the product lies within that error of a half. A
// product farther than 2^-12 from every half rounds as the quotient does (its error is below 2^-15
// for any |x / scale| < 256; beyond, both clamp); the rest (~1 in 2,000 elements; NaN, inf) divide,
// and so does everything when 1/scale is subnormal (fewer bits). Division alone bounded the pass:
// ~1 element a cycle.
constexpr float kSure = 0.5f - 1.0f / 4096;

// The distance to the nearest integer below which the product is trusted: none when 1/scale is
// not a normal float.
inline float trusted(float scale) { return std::isnormal(1.0f / scale) ? kSure : -1.0f; }

void quantize_range(const float* x, float scale, int64_t n, uint8_t* out) {
  int64_t i = 0;
#ifdef __AVX512F__
  const __m512 s = _mm512_set1_ps(scale), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  const __m512 inv = _mm512_set1_ps(1.0f / scale), sure = _mm512_set1_ps(trusted(scale));
  const __m512i offset = _mm512_set1_epi32(128);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __m512 p = _mm512_mul_ps(v, inv);
    __m512 q = _mm512_roundscale_ps(p, kNearest);
    const __mmask16 near_half = _mm512_cmp_ps_mask(_mm512_abs_ps(_mm512_sub_ps(p, q)), sure, _CMP_NLT_UQ);
    if (near_half) q = _mm512_mask_roundscale_ps(q, near_half, _mm512_div_ps(v, s), kNearest);
    q = _mm512_min_ps(_mm512_max_ps(q, lo), hi);
    const __m512i u = _mm512_add_epi32(_mm512_cvtps_epi32(q), offset);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i), _mm512_cvtepi32_epi8(u));
  }
#elif defined(__AVX2__)
  const __m256 s = _mm256_set1_ps(scale), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  const __m256 inv = _mm256_set1_ps(1.0f / scale), sure = _mm256_set1_ps(trusted(scale));
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256i offset = _mm256_set1_epi32(128);
  // packs/packus work within 128-bit lanes: this puts the 32 bytes back in order
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  constexpr int kNearest = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  auto codes = [&](int64_t j) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const __m256 p = _mm256_mul_ps(v, inv);
    __m256 q = _mm256_round_ps(p, kNearest);
    const __m256 near_half = _mm256_cmp_ps(_mm256_andnot_ps(sign, _mm256_sub_ps(p, q)), sure, _CMP_NLT_UQ);
    if (_mm256_movemask_ps(near_half)) q = _mm256_blendv_ps(q, _mm256_round_ps(_mm256_div_ps(v, s), kNearest), near_half);
    q = _mm256_min_ps(_mm256_max_ps(q, lo), hi);
    return _mm256_add_epi32(_mm256_cvtps_epi32(q), offset);      // 1..255
  };
  for (; i + 32 <= n; i += 32) {
    const __m256i ab = _mm256_packs_epi32(codes(i), codes(i + 8));
    const __m256i cd = _mm256_packs_epi32(codes(i + 16), codes(i + 24));
    const __m256i bytes = _mm256_permutevar8x32_epi32(_mm256_packus_epi16(ab, cd), order);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), bytes);
  }
#endif
  for (; i < n; ++i) out[i] = quantize_one(x[i], scale);
}

at::Tensor quantize_u8(const at::Tensor& x, double scale) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "quantize_u8: x must be float32");
  TORCH_CHECK(scale > 0 && std::isfinite(scale), "quantize_u8: the scale must be positive and finite, got ", scale);
  const at::Tensor xc = x.contiguous();
  at::Tensor out = at::empty(xc.sizes(), xc.options().dtype(at::kByte));
  const float* xp = xc.const_data_ptr<float>();
  uint8_t* op = out.data_ptr<uint8_t>();
  const float s = static_cast<float>(scale);
  llmnpu::parallel_pieces(xc.numel(), 1 << 15, [&](int64_t b, int64_t e) { quantize_range(xp + b, s, e - b, op + b); });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("quantize_u8(Tensor x, float scale) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("quantize_u8", &quantize_u8);
}
