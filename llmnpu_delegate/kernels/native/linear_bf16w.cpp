// llmnpu_native::linear_bf16w: y = x @ W^T + b for a few rows of x (fp32) against bf16 weights, fp32
// products and sums. The prefill's last step is the LM head on one row: a matrix-vector product that
// only streams the weight (Qwen2-0.5B's tied head is 545 MB in fp32, ~31 ms), after every NPU task,
// so nothing hides it. Half the bytes halve it; widening bf16 to fp32 is exact, so the only change
// from the fp32 head is the weights' rounding to bf16. runtime/fuse.py swaps the head for this op.
#include <torch/library.h>
#include <ATen/ATen.h>

#include <cstring>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// dot of n fp32 values with n bf16 values, fp32 accumulation
inline float dot_bf16w(const float* x, const uint16_t* w, int64_t n) {
  int64_t k = 0;
  float sum = 0.0f;
#ifdef __AVX512F__
  __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
  for (; k + 32 <= n; k += 32) {
    const __m512i lo = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + k))), 16);
    const __m512i hi = _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(w + k + 16))), 16);
    acc0 = _mm512_fmadd_ps(_mm512_castsi512_ps(lo), _mm512_loadu_ps(x + k), acc0);
    acc1 = _mm512_fmadd_ps(_mm512_castsi512_ps(hi), _mm512_loadu_ps(x + k + 16), acc1);
  }
  sum = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
  for (; k + 16 <= n; k += 16) {
    const __m256i lo = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + k))), 16);
    const __m256i hi = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)(w + k + 8))), 16);
    acc0 = _mm256_fmadd_ps(_mm256_castsi256_ps(lo), _mm256_loadu_ps(x + k), acc0);
    acc1 = _mm256_fmadd_ps(_mm256_castsi256_ps(hi), _mm256_loadu_ps(x + k + 8), acc1);
  }
  const __m256 both = _mm256_add_ps(acc0, acc1);
  __m128 q = _mm_add_ps(_mm256_castps256_ps128(both), _mm256_extractf128_ps(both, 1));
  q = _mm_add_ps(q, _mm_movehl_ps(q, q));
  q = _mm_add_ss(q, _mm_movehdup_ps(q));
  sum = _mm_cvtss_f32(q);
#endif
  for (; k < n; ++k) {
    const uint32_t bits = static_cast<uint32_t>(w[k]) << 16;
    float wk;
    std::memcpy(&wk, &bits, sizeof(wk));
    sum += x[k] * wk;
  }
  return sum;
}

at::Tensor linear_bf16w(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() >= 1, "linear_bf16w: x must be float32");
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.size(1) == x.size(-1),
              "linear_bf16w: weight must be bf16 [N, K] with K = x.size(-1)");
  const int64_t K = weight.size(1), N = weight.size(0), M = K ? x.numel() / K : 0;
  const at::Tensor xc = x.contiguous(), wc = weight.contiguous();
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = N;
  at::Tensor y = at::empty(shape, xc.options());
  const float* xp = xc.const_data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(wc.const_data_ptr<at::BFloat16>());
  float* yp = y.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)          // each weight row is read once, for every row of x
    for (int64_t m = 0; m < M; ++m) yp[m * N + n] = dot_bf16w(xp + m * K, wp + n * K, K);
  if (bias.has_value()) y.add_(*bias);
  return y;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("linear_bf16w(Tensor x, Tensor weight, Tensor? bias=None) -> Tensor");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("linear_bf16w", &linear_bf16w);
}
