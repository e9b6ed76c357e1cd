// llmnpu_native::chunk_attention_bf16: one prefill chunk's attention with bf16 operands, fp32
// accumulation and an fp32 softmax.
//
// The float worker spends most of a prefill in attention (~0.6 s of ~0.8 s per 1,024 tokens on the
// embedded model), and fp32 SDPA already runs near the core's fp32 peak. This CPU's VDPBF16PS does
// twice the multiply-adds per instruction, and oneDNN's brgemm micro-kernel (at::native::cpublas::
// brgemm, bf16 x bf16 -> fp32, B in VNNI pairs) reaches ~400 GFLOPS on one core against ~90 for fp32
// SDPA. What is rounded to bf16: q * scale, k, v, and the unnormalised probabilities exp(s - max);
// the scores, their maximum, the exponentials' sum and the output stay fp32. On the embedded model
// that keeps the logits 48 dB from fp32 attention (tests/test_attention_precision.py).
//
// Work per KV head: queries of the g heads sharing it are stacked, position-major, in blocks of
// ~kRows rows; a block reads only the key tiles its mask can see (the causal diagonal's later tiles
// and a sliding window's earlier ones are skipped) and keeps its scores in L2.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LLMNPU_BF16_ATTENTION 1
#include <immintrin.h>

#include "vec_exp.h"
#endif

namespace {

bool supported() {
#ifdef LLMNPU_BF16_ATTENTION
  return __builtin_cpu_supports("avx512bf16");
#else
  return false;
#endif
}

#ifdef LLMNPU_BF16_ATTENTION

constexpr int64_t kTile = 64;   // key ranges in whole tiles: GEMM widths in steps of 64 (brgemm
                                // compiles each shape once per thread), softmax rows without a tail
constexpr int64_t kRows = 96;   // query rows (g heads x positions) per block: scores [96, L] stay in L2

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// One row of a block: mask the scores s[0, w) (keys k0..k0+w), softmax numerators into p as bf16.
// Returns the sum of the exponentials (0 when the mask hides every key).
float softmax_row(float* s, const uint8_t* keep, const float* add, int64_t w, uint16_t* p) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 vmax = ninf;
  for (int64_t j = 0; j < w; j += 16) {
    __m512 x = _mm512_loadu_ps(s + j);
    if (add) {
      x = _mm512_add_ps(x, _mm512_loadu_ps(add + j));
    } else {
      const __mmask16 k = _mm_test_epi8_mask(_mm_loadu_si128(reinterpret_cast<const __m128i*>(keep + j)),
                                             _mm_set1_epi8(1));
      x = _mm512_mask_blend_ps(k, ninf, x);
    }
    _mm512_storeu_ps(s + j, x);
    vmax = _mm512_max_ps(vmax, x);
  }
  const float mx = _mm512_reduce_max_ps(vmax);
  if (mx == -std::numeric_limits<float>::infinity()) {
    std::fill(p, p + w, uint16_t{0});
    return 0.0f;
  }
  const __m512 vm = _mm512_set1_ps(mx);
  __m512 vsum = _mm512_setzero_ps();
  for (int64_t j = 0; j < w; j += 16) {
    const __m512 x = _mm512_loadu_ps(s + j);
    const __mmask16 live = _mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_UQ);
    // masked lanes are zeroed here: exp_ps gives ~1e-38 for them, not 0
    const __m512 e = _mm512_maskz_mov_ps(live, llmnpu::exp_ps(_mm512_sub_ps(x, vm)));
    const __m256bh b = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)b);
    // the sum is of the rounded numerators, so that the probabilities used sum to one
    vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(b));
  }
  return _mm512_reduce_add_ps(vsum);
}

at::Tensor attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& mask,
                     double scale) {
  using at::native::cpublas::brgemm;
  const int64_t H = q.size(1), C = q.size(2), d = q.size(3), KV = k.size(1), L = k.size(2);
  const int64_t g = H / KV, Lp = round_up(L, kTile);
  const bool boolean = mask.scalar_type() == at::kBool;

  // Operands in bf16. q: [KV, C, g, d], so that a block's rows (position-major) are contiguous.
  const at::Tensor qb = (q[0] * scale).to(at::kBFloat16).view({KV, g, C, d}).permute({0, 2, 1, 3}).contiguous();
  // k as VNNI pairs of the GEMM's B = k^T: [KV, d/2, Lp] 32-bit pairs (k[n, 2i], k[n, 2i+1]).
  at::Tensor kp = at::zeros({KV, d / 2, Lp}, at::kInt);
  kp.narrow(2, 0, L).copy_(k[0].to(at::kBFloat16).contiguous().view(at::kInt).transpose(1, 2));
  // v as VNNI pairs of B = v: [KV, Lp/2, d, 2] (v[2i, j], v[2i+1, j]); rows past L are zero.
  at::Tensor vb = at::zeros({KV, Lp, d}, at::kBFloat16);
  vb.narrow(1, 0, L).copy_(v[0]);
  const at::Tensor vp = vb.view({KV, Lp / 2, 2, d}).transpose(2, 3).contiguous();
  // The mask as [C, Lp] rows, padded past L with "hidden".
  at::Tensor m2 = boolean ? at::zeros({C, Lp}, at::kByte)
                          : at::full({C, Lp}, -std::numeric_limits<float>::infinity(), at::kFloat);
  m2.narrow(1, 0, L).copy_(mask.reshape({C, L}));
  // Per position, the first and one-past-last visible key (bool masks; an additive mask reads all).
  std::vector<int64_t> lo(C, 0), hi(C, L);
  if (boolean) {
    const uint8_t* mp = m2.data_ptr<uint8_t>();
    for (int64_t r = 0; r < C; ++r) {
      const uint8_t* row = mp + r * Lp;
      int64_t a = 0, b = L;
      while (a < L && !row[a]) ++a;
      while (b > a && !row[b - 1]) --b;
      lo[r] = a;
      hi[r] = b;
    }
  }

  at::Tensor out = at::empty({1, C, H, d}, q.options());
  const int64_t rows_per_block = std::max<int64_t>(1, kRows / g);
  const int64_t max_rows = rows_per_block * g;
  std::vector<float> scores(max_rows * Lp), o(max_rows * d), sums(max_rows);
  std::vector<uint16_t> probs(max_rows * Lp);
  const at::BFloat16* qd = qb.data_ptr<at::BFloat16>();
  const at::BFloat16* kd = reinterpret_cast<const at::BFloat16*>(kp.data_ptr<int32_t>());
  const at::BFloat16* vd = vp.data_ptr<at::BFloat16>();
  float* od = out.data_ptr<float>();

  for (int64_t kh = 0; kh < KV; ++kh) {
    for (int64_t r0 = 0; r0 < C; r0 += rows_per_block) {
      const int64_t r1 = std::min(C, r0 + rows_per_block), M = (r1 - r0) * g;
      int64_t ks = L, ke = 0;
      for (int64_t r = r0; r < r1; ++r) {
        if (lo[r] < hi[r]) {
          ks = std::min(ks, lo[r]);
          ke = std::max(ke, hi[r]);
        }
      }
      if (ks >= ke) {   // every key hidden from every row of the block
        for (int64_t r = r0; r < r1; ++r)
          std::fill(od + (r * H + kh * g) * d, od + (r * H + kh * g + g) * d, 0.0f);
        continue;
      }
      ks = ks / kTile * kTile;
      ke = round_up(ke, kTile);
      const int64_t w = ke - ks;
      const at::BFloat16* a = qd + (kh * C + r0) * g * d;
      // scores [M, w] = q_block @ k^T over the visible key tiles, in one call
      brgemm(M, w, d, d, Lp, Lp, false, a, kd + (kh * (d / 2) * Lp + ks) * 2, scores.data(), true);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t r = r0 + i / g;
        const uint8_t* keep = boolean ? m2.data_ptr<uint8_t>() + r * Lp + ks : nullptr;
        const float* add = boolean ? nullptr : m2.data_ptr<float>() + r * Lp + ks;
        sums[i] = softmax_row(scores.data() + i * Lp, keep, add, w, probs.data() + i * Lp);
      }
      // o [M, d] = p @ v, reducing over the same keys
      brgemm(M, d, w, Lp, d, d, false, reinterpret_cast<const at::BFloat16*>(probs.data()),
             vd + (kh * (Lp / 2) + ks / 2) * d * 2, o.data(), true);
      for (int64_t i = 0; i < M; ++i) {
        const int64_t r = r0 + i / g, h = kh * g + i % g;
        const float inv = sums[i] > 0.0f ? 1.0f / sums[i] : 0.0f;
        float* dst = od + (r * H + h) * d;
        for (int64_t j = 0; j < d; ++j) dst[j] = o[i * d + j] * inv;
      }
    }
  }
  at::native::cpublas::brgemm_release();
  return out;
}

#endif  // LLMNPU_BF16_ATTENTION

// q [1, H, C, d], k/v [1, KV, L, d] (float), mask broadcastable as [C, L] (bool: attend; or an
// additive float mask) -> [1, C, H, d], the layout transformers' attention returns.
at::Tensor chunk_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, double scale) {
  TORCH_CHECK(supported(), "chunk_attention_bf16 needs AVX-512 BF16 in this CPU and in the build "
              "(make kernels on such a machine); use fp32 attention here");
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4 && q.size(0) == 1 && k.size(0) == 1 && v.sizes() == k.sizes(),
              "chunk_attention_bf16: q [1, H, C, d], k and v [1, KV, L, d]");
  TORCH_CHECK(q.scalar_type() == at::kFloat && k.scalar_type() == at::kFloat && v.scalar_type() == at::kFloat,
              "chunk_attention_bf16: q, k and v must be float32");
  TORCH_CHECK(q.size(3) == k.size(3) && q.size(3) % 2 == 0 && k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "chunk_attention_bf16: head dims must match and be even, and KV must divide H");
  TORCH_CHECK(mask.dim() >= 2 && mask.size(-2) == q.size(2) && mask.size(-1) == k.size(2) &&
                  mask.numel() == q.size(2) * k.size(2),
              "chunk_attention_bf16: the mask must be one [C, L] matrix shared by all heads");
  TORCH_CHECK(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kFloat,
              "chunk_attention_bf16: the mask must be bool or float");
#ifdef LLMNPU_BF16_ATTENTION
  return attention(q, k, v, mask, scale);
#else
  return at::Tensor();
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("chunk_attention_bf16(Tensor q, Tensor k, Tensor v, Tensor mask, float scale) -> Tensor");
  m.def("bf16_attention_supported() -> bool", &supported);
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("chunk_attention_bf16", &chunk_attention_bf16);
}
