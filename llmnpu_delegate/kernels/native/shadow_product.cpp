// llmnpu_native::shadow_product: the shadow outlier branch of one linear in a single pass.
//
// For x [M, K] and a threshold t, the elements with |x| > t lose (|x| - t) to saturation on the
// NPU; the branch adds back residue @ W^T, where residue = x - clamp(x, -t, t). Outliers are ~1 % of
// the elements, so the product is done per outlier: y[m, :] += residue[m, k] * W^T[k, :]. Work is
// one scan of x plus one row of W^T per outlier, and only hit rows of the (memory-mapped) W^T are
// read. Torch ops need a compaction, a CSR build and a sparse GEMM for the same, several times
// slower on the embedded model's shapes (kernels/ops.py keeps that version as the reference).
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

// out[0:kTile] (+)= sum_j res[j] * rows[j][n0:n0 + kTile]: the tile stays in registers while every
// outlier's row adds into it (one fused multiply-add each, in the outliers' order, as the scalar
// tail does), and is stored once. With ``add`` the sum is added to out after, in one rounding: the
// same value as the product computed apart and then added (a placement may do either).
constexpr int64_t kTile = 64;
inline void add_rows_tile(float* out, bool add, const float* res, const float* const* rows, int64_t count, int64_t n0) {
#if defined(__AVX512F__)
  __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
  for (int64_t j = 0; j < count; ++j) {
    const __m512 r = _mm512_set1_ps(res[j]);
    for (int v = 0; v < 4; ++v) a[v] = _mm512_fmadd_ps(r, _mm512_loadu_ps(rows[j] + n0 + 16 * v), a[v]);
  }
  for (int v = 0; v < 4; ++v)
    _mm512_storeu_ps(out + 16 * v, add ? _mm512_add_ps(_mm512_loadu_ps(out + 16 * v), a[v]) : a[v]);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 a[8];
  for (int v = 0; v < 8; ++v) a[v] = _mm256_setzero_ps();
  for (int64_t j = 0; j < count; ++j) {
    const __m256 r = _mm256_set1_ps(res[j]);
    for (int v = 0; v < 8; ++v) a[v] = _mm256_fmadd_ps(r, _mm256_loadu_ps(rows[j] + n0 + 8 * v), a[v]);
  }
  for (int v = 0; v < 8; ++v)
    _mm256_storeu_ps(out + 8 * v, add ? _mm256_add_ps(_mm256_loadu_ps(out + 8 * v), a[v]) : a[v]);
#else
  float a[kTile] = {};
  for (int64_t j = 0; j < count; ++j)
    for (int64_t i = 0; i < kTile; ++i) a[i] = std::fma(res[j], rows[j][n0 + i], a[i]);
  for (int64_t i = 0; i < kTile; ++i) out[i] = add ? out[i] + a[i] : a[i];
#endif
}

// y [M, N] = (x - clamp(x, -t, t)) @ W^T for x [M, K], W^T's rows in ``hot``/``cold`` (``add``: y +=
// that, and a row without outliers is not touched); marks the hit channels, returns the outlier count.
// One row of x at a time: its outliers first (a whole block of x is tested with one or two vector
// compares, and only a block that fires is walked: most hold no outlier), then its output row in
// tiles that stay in registers while each outlier's row adds into them. The rows are what the
// product waits on (read from DRAM: a layer's rows are not in cache), so each row is read once per
// outlier and the output once per tile.
int64_t product_rows(const float* xp, int64_t M, int64_t K, float t, const float* hp, const float* cp, const int64_t* sp,
                     int64_t N, float* yp, bool add, std::vector<uint8_t>& hit) {
  // 16 spare slots: a compressed block is stored whole, its unused lanes past the outliers' end
  std::vector<float> res(K + 16);
  std::vector<int32_t> at(K + 16);   // the outliers' channels
  std::vector<const float*> rows(K);
  int64_t outliers = 0;
  constexpr int64_t kBlock = 16;   // one AVX-512 register of floats
  const int64_t full = K - K % kBlock;
  // Appends the outliers of row[k0, k1) after the count already found: (residue, channel), in order.
  auto walk = [&](const float* row, int64_t k0, int64_t k1, int64_t count) {
    for (int64_t k = k0; k < k1; ++k) {
      const float r = row[k] - std::clamp(row[k], -t, t);
      if (r == 0.0f) continue;
      res[count] = r;
      at[count++] = static_cast<int32_t>(k);
    }
    return count;
  };
  for (int64_t m = 0; m < M; ++m) {
    const float* row = xp + m * K;
    int64_t count = 0;
#if defined(__AVX512F__)
    // a block that fires is walked without a branch per element: its residues and channels are
    // compressed in registers and stored whole (the same values and order as the walk). Compressed
    // straight to memory, they cost ~20x more on AMD Zen 4, where that form is microcoded.
    const __m512 vt = _mm512_set1_ps(t), vnt = _mm512_set1_ps(-t);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t k0 = 0; k0 < full; k0 += kBlock) {
      if (!any_above(row + k0, t)) continue;
      const __m512 x = _mm512_loadu_ps(row + k0);
      // max(-t, x) and min(t, .) return x itself when x is NaN, as std::clamp does
      const __m512 r = _mm512_sub_ps(x, _mm512_min_ps(vt, _mm512_max_ps(vnt, x)));
      const __mmask16 keep = _mm512_cmp_ps_mask(r, _mm512_setzero_ps(), _CMP_NEQ_UQ);
      _mm512_storeu_ps(res.data() + count, _mm512_maskz_compress_ps(keep, r));
      _mm512_storeu_si512(at.data() + count, _mm512_maskz_compress_epi32(
                                                 keep, _mm512_add_epi32(lane, _mm512_set1_epi32(static_cast<int32_t>(k0)))));
      count += __builtin_popcount(keep);
    }
#else
    for (int64_t k0 = 0; k0 < full; k0 += kBlock)
      if (any_above(row + k0, t)) count = walk(row, k0, k0 + kBlock, count);
#endif
    count = walk(row, full, K, count);
    for (int64_t j = 0; j < count; ++j) {
      const int64_t k = at[j];
      rows[j] = sp[k] >= 0 ? hp + sp[k] * N : cp + (-1 - sp[k]) * N;
      hit[k] = 1;
    }
    outliers += count;
    if (add && count == 0) continue;
    float* out = yp + m * N;
    int64_t n0 = 0;
    for (; n0 + kTile <= N; n0 += kTile)
      add_rows_tile(out + n0, add, res.data(), rows.data(), count, n0);
    for (; n0 < N; ++n0) {
      float acc = 0.0f;
      for (int64_t j = 0; j < count; ++j) acc = std::fma(res[j], rows[j][n0], acc);
      out[n0] = add ? out[n0] + acc : acc;
    }
  }
  return outliers;
}

void check_tables(const at::Tensor& x, double threshold, const at::Tensor& hot, const at::Tensor& cold,
                  const at::Tensor& slot) {
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
}

// y [M, N] (+)= the product; returns the hit input channels (sorted) and the number of outliers.
std::tuple<at::Tensor, int64_t> product_into(at::Tensor& y, bool add, const at::Tensor& x, double threshold,
                                             const at::Tensor& hot, const at::Tensor& cold, const at::Tensor& slot) {
  const at::Tensor xc = x.contiguous(), hc = hot.contiguous(), cc = cold.contiguous(), sc = slot.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), N = hc.size(1);
  std::vector<uint8_t> hit(K, 0);
  const int64_t outliers = product_rows(xc.data_ptr<float>(), M, K, static_cast<float>(threshold), hc.data_ptr<float>(),
                                        cc.data_ptr<float>(), sc.data_ptr<int64_t>(), N, y.data_ptr<float>(), add, hit);
  std::vector<int64_t> channels;
  for (int64_t k = 0; k < K; ++k)
    if (hit[k]) channels.push_back(k);
  at::Tensor ch = at::empty({static_cast<int64_t>(channels.size())}, at::kLong);
  std::copy(channels.begin(), channels.end(), ch.data_ptr<int64_t>());
  return {ch, outliers};
}

// Returns y [M, N], the hit input channels (sorted) and the number of outlier elements.
std::tuple<at::Tensor, at::Tensor, int64_t> shadow_product(const at::Tensor& x, double threshold, const at::Tensor& hot,
                                                          const at::Tensor& cold, const at::Tensor& slot) {
  check_tables(x, threshold, hot, cold, slot);
  at::Tensor y = at::empty({x.size(0), hot.size(1)}, x.options().dtype(at::kFloat));
  auto [ch, outliers] = product_into(y, false, x, threshold, hot, cold, slot);
  return {y, ch, outliers};
}

// y += the product, in place (the merge of a shadow branch into its linear's output, without a
// separate add pass over y); returns the hit input channels and the number of outlier elements.
std::tuple<at::Tensor, int64_t> shadow_product_add_(at::Tensor& y, const at::Tensor& x, double threshold,
                                                    const at::Tensor& hot, const at::Tensor& cold, const at::Tensor& slot) {
  check_tables(x, threshold, hot, cold, slot);
  TORCH_CHECK(y.dim() == 2 && y.scalar_type() == at::kFloat && y.is_contiguous() && y.size(0) == x.size(0) &&
                  y.size(1) == hot.size(1),
              "shadow_product_add_: y must be a contiguous float [M, N] matrix, M as x's rows and N as the tables'");
  return product_into(y, true, x, threshold, hot, cold, slot);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("shadow_product(Tensor x, float threshold, Tensor hot, Tensor cold, Tensor slot) -> (Tensor, Tensor, int)");
  m.def("shadow_product_add_(Tensor(a!) y, Tensor x, float threshold, Tensor hot, Tensor cold, Tensor slot) -> (Tensor, int)");
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("shadow_product", &shadow_product);
  m.impl("shadow_product_add_", &shadow_product_add_);
}
