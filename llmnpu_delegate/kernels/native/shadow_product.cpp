// llmnpu_native::shadow_product: the shadow outlier branch of one linear in a single pass.
//
// For x [M, K] and a threshold t, the elements with |x| > t lose (|x| - t) to saturation on the
// NPU; the branch adds back residue @ W^T, where residue = x - clamp(x, -t, t). Outliers are ~1 % of
// the elements, so the product is done per outlier: y[m, :] += residue[m, k] * W^T[k, :]. Work is
// one scan of x plus one row of W^T per outlier, and only hit rows of the (memory-mapped) W^T are
// read. Torch ops need a compaction, a CSR build and a sparse GEMM for the same (~0.6 ms a call on
// the embedded model's shapes against ~0.2 ms here; kernels/ops.py keeps that version).
//
// W^T's rows come from two tables: ``hot`` (rows kept in RAM) and ``cold`` (the rest, usually a
// memory-mapped file, read only where hit); ``slot[k]`` says where channel k's row is: i >= 0 is
// hot row i, -1 - j is cold row j (format/rows.py's RowStore builds all three).
#include <torch/library.h>
#include <ATen/ATen.h>

#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

// Whether any of the 16 floats at p has |x| > t: one compare on AVX-512, two on AVX2.
inline bool any_above(const float* p, float t) {
#if defined(__AVX512F__)
  const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(p));
  return _mm512_cmp_ps_mask(a, _mm512_set1_ps(t), _CMP_GT_OQ) != 0;
#elif defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.0f), vt = _mm256_set1_ps(t);
  const __m256 a = _mm256_andnot_ps(sign, _mm256_loadu_ps(p));
  const __m256 b = _mm256_andnot_ps(sign, _mm256_loadu_ps(p + 8));
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(a, vt, _CMP_GT_OQ), _mm256_cmp_ps(b, vt, _CMP_GT_OQ))) != 0;
#else
  for (int j = 0; j < 16; ++j)
    if (std::fabs(p[j]) > t) return true;
  return false;
#endif
}

// Returns y [M, N], the hit input channels (sorted) and the number of outlier elements.
std::tuple<at::Tensor, at::Tensor, int64_t> shadow_product(const at::Tensor& x, double threshold, const at::Tensor& hot,
                                                          const at::Tensor& cold, const at::Tensor& slot) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "shadow_product: x must be a float [M, K] matrix");
  TORCH_CHECK(hot.dim() == 2 && cold.dim() == 2 && hot.scalar_type() == at::kFloat && cold.scalar_type() == at::kFloat &&
                  hot.size(1) == cold.size(1),
              "shadow_product: hot and cold must be float row tables [h, N] and [c, N] of one W^T");
  TORCH_CHECK(slot.dim() == 1 && slot.scalar_type() == at::kLong && slot.size(0) == x.size(1),
              "shadow_product: slot must be an int64 [K] map of x's channels to rows");
  TORCH_CHECK(threshold >= 0, "shadow_product: the threshold must not be negative");
  const at::Tensor sc = slot.contiguous();
  const int64_t* sp = sc.data_ptr<int64_t>();
  for (int64_t k = 0; k < sc.size(0); ++k)
    TORCH_CHECK(sp[k] < hot.size(0) && -1 - sp[k] < cold.size(0), "shadow_product: slot[", k, "] = ", sp[k],
                " names no row of the tables");
  const at::Tensor xc = x.contiguous();
  const at::Tensor hc = hot.contiguous();
  const at::Tensor cc = cold.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = hc.size(1);
  at::Tensor y = at::zeros({M, N}, xc.options());
  const float* xp = xc.data_ptr<float>();
  const float* hp = hc.data_ptr<float>();
  const float* cp = cc.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float t = static_cast<float>(threshold);
  std::vector<uint8_t> hit(K, 0);
  int64_t outliers = 0;
  // Most blocks hold no outlier (~85 % at a 1 % rate): a whole block is tested with one or two
  // vector compares, and only a block that fires is walked element by element. The product adds one row of W^T per outlier, on restrict pointers (no aliasing
  // checks, so it vectorises).
  constexpr int64_t kBlock = 16;   // one AVX-512 register of floats
  const int64_t full = K - K % kBlock;
  auto add_row = [&](float* __restrict out, int64_t k, float r) {
    const float* __restrict w = sp[k] >= 0 ? hp + sp[k] * N : cp + (-1 - sp[k]) * N;
    for (int64_t n = 0; n < N; ++n) out[n] += r * w[n];
    hit[k] = 1;
    ++outliers;
  };
  auto walk = [&](const float* row, float* out, int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const float r = row[k] - std::clamp(row[k], -t, t);
      if (r != 0.0f) add_row(out, k, r);
    }
  };
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    float* out = yp + m * N;
    for (int64_t k0 = 0; k0 < full; k0 += kBlock)
      if (any_above(row + k0, t)) walk(row, out, k0, k0 + kBlock);
    walk(row, out, full, K);
  }
  std::vector<int64_t> channels;
  for (int64_t k = 0; k < K; ++k)
    if (hit[k]) channels.push_back(k);
  at::Tensor ch = at::empty({static_cast<int64_t>(channels.size())}, at::kLong);
  std::copy(channels.begin(), channels.end(), ch.data_ptr<int64_t>());
  return {y, ch, outliers};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("shadow_product(Tensor x, float threshold, Tensor hot, Tensor cold, Tensor slot) -> (Tensor, Tensor, int)");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("shadow_product", &shadow_product);
}
