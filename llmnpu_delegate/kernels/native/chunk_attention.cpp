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
//
// The packing and the (KV head, block) pairs are independent pieces of `llmnpu::parallel_pieces`
// (lane_help.h): in a prefill the NPU worker, idle while the CPU lane attends (a later turn's chunks
// attend over a long past), runs some of them. Each piece writes only its own outputs, with its own
// scratch, so the result is the same whichever thread runs which piece.
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/native/CPUBlas.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512BF16__)
#define LLMNPU_BF16_ATTENTION 1
#include <immintrin.h>

#endif

#include "lane_help.h"

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

// exp(x - max) for x <= max, the softmax numerator before its rounding to bf16: exp2 of a reduced
// argument (degree-5 polynomial on [-1/2, 1/2]), ~10 instructions against vec_exp.h's ~14. Its error,
// ~6e-8 |x - max| + 1e-7 relative, is invisible through the bf16 rounding (4e-3) that follows. Scores
// far below the max (or -inf) give 2^-127 or 0; masked lanes are zeroed by the callers.
inline __m512 numerator(__m512 x, __m512 max) {
  const __m512 t = _mm512_max_ps(_mm512_mul_ps(_mm512_sub_ps(x, max), _mm512_set1_ps(1.44269504088896341f)),
                                 _mm512_set1_ps(-127.0f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, n);
  __m512 p = _mm512_set1_ps(1.3333558146e-3f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.6181291076e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5504108665e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4022650696e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9314718056e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

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
    const __m512 e = _mm512_maskz_mov_ps(live, numerator(x, vm));
    const __m256bh b = _mm512_cvtneps_pbh(e);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)b);
    // the sum is of the rounded numerators, so that the probabilities used sum to one
    vsum = _mm512_add_ps(vsum, _mm512_cvtpbh_ps(b));
  }
  return _mm512_reduce_add_ps(vsum);
}

// The lanes of the tile of keys [j, j + 16) that fall in [a, b).
inline __mmask16 lanes(int64_t j, int64_t a, int64_t b) {
  const uint32_t lo = static_cast<uint32_t>(std::clamp<int64_t>(a - j, 0, 16));
  const uint32_t hi = static_cast<uint32_t>(std::clamp<int64_t>(b - j, 0, 16));
  return static_cast<__mmask16>(((1u << hi) - 1u) & ~((1u << lo) - 1u));
}

// softmax_row for a row that sees exactly the keys [a, b) of [0, w) (causal and sliding-window rows,
// nearly all): no mask is read, the scores are not written back, and the tiles outside the span get
// zeros without an exponential. The max and the sum are split over several registers, because each
// max or add waits ~4 cycles for the one before it. Same numerators as softmax_row; the sum is in
// another order.
float softmax_span(const float* s, int64_t a, int64_t b, int64_t w, uint16_t* p) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t t0 = a / 16 * 16, t1 = std::min(w, round_up(b, 16));
  const int64_t in0 = std::min(t1, round_up(a, 16)), in1 = std::max(in0, b / 16 * 16);   // whole tiles
  std::fill(p, p + t0, uint16_t{0});
  std::fill(p + t1, p + w, uint16_t{0});
  __m512 m0 = ninf, m1 = ninf, m2 = ninf, m3 = ninf;
  int64_t j = t0;
  for (; j < in0; j += 16) m0 = _mm512_mask_max_ps(m0, lanes(j, a, b), m0, _mm512_loadu_ps(s + j));
  for (; j + 64 <= in1; j += 64) {
    m0 = _mm512_max_ps(m0, _mm512_loadu_ps(s + j));
    m1 = _mm512_max_ps(m1, _mm512_loadu_ps(s + j + 16));
    m2 = _mm512_max_ps(m2, _mm512_loadu_ps(s + j + 32));
    m3 = _mm512_max_ps(m3, _mm512_loadu_ps(s + j + 48));
  }
  for (; j < t1; j += 16) m1 = _mm512_mask_max_ps(m1, lanes(j, a, b), m1, _mm512_loadu_ps(s + j));
  const __m512 vm = _mm512_set1_ps(_mm512_reduce_max_ps(_mm512_max_ps(_mm512_max_ps(m0, m1), _mm512_max_ps(m2, m3))));
  __m512 sum[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
  for (j = t0; j < t1; j += 16) {
    const __mmask16 k = j >= in0 && j < in1 ? __mmask16(0xFFFF) : lanes(j, a, b);
    const __m256bh h = _mm512_cvtneps_pbh(_mm512_maskz_mov_ps(k, numerator(_mm512_loadu_ps(s + j), vm)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + j), (__m256i)h);
    // the sum is of the rounded numerators, so that the probabilities used sum to one
    sum[(j >> 4) & 1] = _mm512_add_ps(sum[(j >> 4) & 1], _mm512_cvtpbh_ps(h));
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(sum[0], sum[1]));
}

// bf16 of 16 floats, rounded to nearest even.
inline __m256i bf16x16(__m512 x) { return (__m256i)_mm512_cvtneps_pbh(x); }

inline uint16_t bf16_bits(float x) { return c10::BFloat16(x).x; }

// Row n of head h of a [1, heads, rows, d] float tensor whose rows are contiguous.
inline const float* row(const at::Tensor& t, int64_t h, int64_t n) {
  return t.const_data_ptr<float>() + h * t.stride(1) + n * t.stride(2);
}

// d floats (times scale) to bf16 bits.
inline void to_bf16(const float* x, float scale, int64_t d, uint16_t* out) {
  int64_t j = 0;
  const __m512 s = _mm512_set1_ps(scale);
  for (; j + 16 <= d; j += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + j), bf16x16(_mm512_mul_ps(_mm512_loadu_ps(x + j), s)));
  for (; j < d; ++j) out[j] = bf16_bits(x[j] * scale);
}

// q * scale as [KV, C, g, d]: the g query heads sharing a KV head, position-major, so that a block of
// positions is one contiguous matrix.
void pack_q(const at::Tensor& q, float scale, int64_t g, uint16_t* out) {
  const int64_t H = q.size(1), C = q.size(2), d = q.size(3), KV = H / g;
  for (int64_t kh = 0; kh < KV; ++kh)
    for (int64_t r = 0; r < C; ++r)
      for (int64_t gi = 0; gi < g; ++gi) to_bf16(row(q, kh * g + gi, r), scale, d, out + ((kh * C + r) * g + gi) * d);
}

// k as VNNI pairs of the GEMM's B = k^T: [KV, d/2, Lp] 32-bit words (k[n, 2i], k[n, 2i+1]), keys past L
// zero; here KV head kh's keys [n0, n1) (multiples of 16). A bf16 row read as 32-bit words is already
// its pairs: 16 rows at a time are converted, then written transposed.
void pack_k(const at::Tensor& k, int64_t kh, int64_t n0, int64_t n1, int64_t Lp, uint32_t* out) {
  const int64_t L = k.size(2), d = k.size(3), pairs = d / 2;
  std::vector<uint32_t> block(16 * pairs);
  uint32_t* dst = out + kh * pairs * Lp;
  for (int64_t b = n0; b < n1; b += 16) {
    for (int64_t r = 0; r < 16; ++r) {
      uint32_t* row_out = block.data() + r * pairs;
      if (b + r < L) to_bf16(row(k, kh, b + r), 1.0f, d, reinterpret_cast<uint16_t*>(row_out));
      else std::fill(row_out, row_out + pairs, 0u);
    }
    for (int64_t i = 0; i < pairs; ++i)
      for (int64_t r = 0; r < 16; ++r) dst[i * Lp + b + r] = block[r * pairs + i];
  }
}

// v as VNNI pairs of B = v: [KV, Lp/2, d] 32-bit words (v[2p, j], v[2p+1, j]), rows past L zero; here
// KV head kh's pairs [p0, p1).
void pack_v(const at::Tensor& v, int64_t kh, int64_t p0, int64_t p1, int64_t Lp, uint32_t* out) {
  const int64_t L = v.size(2), d = v.size(3);
  for (int64_t p = p0; p < p1; ++p) {
    const float* a = 2 * p < L ? row(v, kh, 2 * p) : nullptr;
    const float* b = 2 * p + 1 < L ? row(v, kh, 2 * p + 1) : nullptr;
    uint32_t* dst = out + (kh * (Lp / 2) + p) * d;
    int64_t j = 0;
    for (; j + 16 <= d; j += 16) {
      const __m512i lo = a ? _mm512_cvtepu16_epi32(bf16x16(_mm512_loadu_ps(a + j))) : _mm512_setzero_si512();
      const __m512i hi = b ? _mm512_cvtepu16_epi32(bf16x16(_mm512_loadu_ps(b + j))) : _mm512_setzero_si512();
      _mm512_storeu_si512(dst + j, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (; j < d; ++j)
      dst[j] = (a ? bf16_bits(a[j]) : 0u) | (b ? uint32_t{bf16_bits(b[j])} << 16 : 0u);
  }
}

// A piece's working memory, kept per thread: its scores and probabilities [rows, Lp], output [rows, d].
struct Scratch {
  std::vector<float> scores, o, sums;
  std::vector<uint16_t> probs;
};

Scratch& scratch(int64_t rows, int64_t Lp, int64_t d) {
  thread_local Scratch s;
  if (static_cast<int64_t>(s.scores.size()) < rows * Lp) {
    s.scores.resize(rows * Lp);
    s.probs.resize(rows * Lp);
  }
  if (static_cast<int64_t>(s.o.size()) < rows * d) s.o.resize(rows * d);
  if (static_cast<int64_t>(s.sums.size()) < rows) s.sums.resize(rows);
  return s;
}

constexpr int64_t kPackKeys = 256;   // keys per packing piece (a multiple of 16 and of kTile)

at::Tensor attention(const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in, const at::Tensor& mask,
                     double scale) {
  using at::native::cpublas::brgemm;
  // rows of d contiguous floats (the packers read them so); rope and cat give such tensors already
  const at::Tensor q = q_in.stride(3) == 1 ? q_in : q_in.contiguous();
  const at::Tensor k = k_in.stride(3) == 1 ? k_in : k_in.contiguous();
  const at::Tensor v = v_in.stride(3) == 1 ? v_in : v_in.contiguous();
  const int64_t H = q.size(1), C = q.size(2), d = q.size(3), KV = k.size(1), L = k.size(2);
  const int64_t g = H / KV, Lp = round_up(L, kTile);
  const bool boolean = mask.scalar_type() == at::kBool;

  // Operands in bf16, packed in one pass each (the aten ops this replaced made 2-3 passes and
  // took ~15 % of the call).
  at::Tensor qb = at::empty({KV, C, g, d}, q.options().dtype(at::kBFloat16));
  at::Tensor kp = at::empty({KV, d / 2, Lp}, q.options().dtype(at::kInt));
  at::Tensor vp = at::empty({KV, Lp / 2, d, 2}, q.options().dtype(at::kBFloat16));
  pack_q(q, static_cast<float>(scale), g, reinterpret_cast<uint16_t*>(qb.data_ptr<at::BFloat16>()));
  {
    // K and V of each KV head in ranges of kPackKeys keys: [0, n) packs K, [n, 2n) packs V
    uint32_t* kw = reinterpret_cast<uint32_t*>(kp.data_ptr<int32_t>());
    uint32_t* vw = reinterpret_cast<uint32_t*>(vp.data_ptr<at::BFloat16>());
    const int64_t ranges = (Lp + kPackKeys - 1) / kPackKeys, n = KV * ranges;
    llmnpu::parallel_pieces(2 * n, 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const int64_t j = i % n, kh = j / ranges, n0 = j % ranges * kPackKeys, n1 = std::min(Lp, n0 + kPackKeys);
        if (i < n) pack_k(k, kh, n0, n1, Lp, kw);
        else pack_v(v, kh, n0 / 2, n1 / 2, Lp, vw);
      }
    });
  }
  // The mask as [C, Lp] rows, padded past L with "hidden".
  at::Tensor m2 = boolean ? at::zeros({C, Lp}, at::kByte)
                          : at::full({C, Lp}, -std::numeric_limits<float>::infinity(), at::kFloat);
  m2.narrow(1, 0, L).copy_(mask.reshape({C, L}));
  // Per position, the first and one-past-last visible key (bool masks; an additive mask reads all),
  // and whether every key between them is visible (then its softmax reads no mask).
  std::vector<int64_t> lo(C, 0), hi(C, L);
  std::vector<uint8_t> span(C, 0);
  if (boolean) {
    const uint8_t* mp = m2.data_ptr<uint8_t>();
    for (int64_t r = 0; r < C; ++r) {
      const uint8_t* row = mp + r * Lp;
      int64_t a = 0, b = L;
      while (a < L && !row[a]) ++a;
      while (b > a && !row[b - 1]) --b;
      lo[r] = a;
      hi[r] = b;
      span[r] = a < b && std::memchr(row + a, 0, b - a) == nullptr;
    }
  }

  at::Tensor out = at::empty({1, C, H, d}, q.options());
  const int64_t rows_per_block = std::max<int64_t>(1, kRows / g);
  const int64_t max_rows = rows_per_block * g, blocks = (C + rows_per_block - 1) / rows_per_block;
  const at::BFloat16* qd = qb.data_ptr<at::BFloat16>();
  const at::BFloat16* kd = reinterpret_cast<const at::BFloat16*>(kp.data_ptr<int32_t>());
  const at::BFloat16* vd = vp.data_ptr<at::BFloat16>();
  const uint8_t* keep_rows = boolean ? m2.data_ptr<uint8_t>() : nullptr;
  const float* add_rows = boolean ? nullptr : m2.data_ptr<float>();
  float* od = out.data_ptr<float>();

  // One piece: KV head kh, query positions [r0, r1).
  auto block = [&](int64_t kh, int64_t r0) {
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
      return;
    }
    ks = ks / kTile * kTile;
    ke = round_up(ke, kTile);
    const int64_t w = ke - ks;
    Scratch& sc = scratch(max_rows, Lp, d);
    const at::BFloat16* a = qd + (kh * C + r0) * g * d;
    // scores [M, w] = q_block @ k^T over the visible key tiles, in one call
    brgemm(M, w, d, d, Lp, Lp, false, a, kd + (kh * (d / 2) * Lp + ks) * 2, sc.scores.data(), true);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t r = r0 + i / g;
      if (span[r]) {
        sc.sums[i] = softmax_span(sc.scores.data() + i * Lp, lo[r] - ks, hi[r] - ks, w, sc.probs.data() + i * Lp);
        continue;
      }
      sc.sums[i] = softmax_row(sc.scores.data() + i * Lp, keep_rows ? keep_rows + r * Lp + ks : nullptr,
                               add_rows ? add_rows + r * Lp + ks : nullptr, w, sc.probs.data() + i * Lp);
    }
    // o [M, d] = p @ v, reducing over the same keys
    brgemm(M, d, w, Lp, d, d, false, reinterpret_cast<const at::BFloat16*>(sc.probs.data()),
           vd + (kh * (Lp / 2) + ks / 2) * d * 2, sc.o.data(), true);
    for (int64_t i = 0; i < M; ++i) {
      const int64_t r = r0 + i / g, h = kh * g + i % g;
      const float inv = sc.sums[i] > 0.0f ? 1.0f / sc.sums[i] : 0.0f;
      float* dst = od + (r * H + h) * d;
      for (int64_t j = 0; j < d; ++j) dst[j] = sc.o[i * d + j] * inv;
    }
    // brgemm's hardware context (AMX tiles) belongs to the thread: leave none behind on a helper
    at::native::cpublas::brgemm_release();
  };
  llmnpu::parallel_pieces(KV * blocks, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) block(i / blocks, i % blocks * rows_per_block);
  });
  return out;
}

#endif  // LLMNPU_BF16_ATTENTION

// q [1, H, C, d], k/v [1, KV, L, d] (float), mask broadcastable as [C, L] (bool: attend; or an
// additive float mask) -> [1, C, H, d], the layout transformers' attention returns.
at::Tensor chunk_attention_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& mask, double scale) {
  TORCH_CHECK(supported(), "chunk_attention_bf16 needs AVX-512 BF16 in this CPU and in the build "
              "(make kernels on such a machine); use fp32 attention here");
  // oneDNN's brgemm refuses bf16 while oneDNN is off; checked here, on the caller's thread, and not
  // inside a piece that a helper thread may run (a piece must not throw)
  TORCH_CHECK(at::globalContext().userEnabledMkldnn(), "chunk_attention_bf16 runs on oneDNN, which is off "
              "(torch.backends.mkldnn.enabled is False): turn it back on, or use fp32 attention");
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
  (void)scale;   // unreachable: supported() is false in a build without AVX-512 BF16
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
