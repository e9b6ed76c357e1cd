// llmnpu_native::int8_pack / int8_gemm: an exact INT8 GEMM for CPUs where oneDNN's and fbgemm's
// kernels saturate (no VNNI, no AMX): the stand-in NPU's and the shadow linear's arithmetic on AVX2
// and AVX-512 without VNNI, and a portable form for the rest (aarch64).
//
// Contract (the NPU's): C[m, n] = sum_k A[m, k] * W[n, k] exactly in int32, for int8 codes in
// [-127, 127]. Without VNNI the fast u8 x s8 instruction (vpmaddubsw) sums two products into a
// saturating int16; here the codes are widened to int16 once (A per call, W when packed) and
// multiplied with vpmaddwd, which sums two int16 products straight into int32: nothing saturates,
// at the same two multiply instructions per 32 products that the saturating kernels spend.
//
// Every ISA variant is compiled with its own target attribute into one library, so one build holds
// all of them and a test can run each where the CPU allows (kernels/int8_path.py chooses).
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "lane_help.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

constexpr int64_t NR = 16;         // packed panel width (columns); both x86 kernels use 16 or 32
constexpr int64_t KC_PAIRS = 256;  // k pairs per block: a 16-wide panel block is 16 KiB (L1)
constexpr int64_t MC = 96;         // rows per A slice: 96 x 512 int16 = 96 KiB (L2); a multiple of every MR

enum class Isa { portable, avx2, avx512 };

Isa parse_isa(const std::string& name) {
  if (name == "avx2") return Isa::avx2;
  if (name == "avx512") return Isa::avx512;
  TORCH_CHECK(name == "portable", "int8_gemm: unknown path '", name, "' (avx512, avx2 or portable)");
  return Isa::portable;
}

bool isa_supported(Isa isa) {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (isa == Isa::avx2) return __builtin_cpu_supports("avx2");
  if (isa == Isa::avx512) return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return true;
#else
  return isa == Isa::portable;
#endif
}

// Packed W: [ceil(N / NR)][Kp / 2][NR][2] int16, Kp = K rounded up to even, zeros in the padding.
// One panel's k-pair p is 16 int32 lanes of (W[n, 2p], W[n, 2p + 1]): what vpmaddwd multiplies
// with a broadcast (A[m, 2p], A[m, 2p + 1]).
at::Tensor int8_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kChar, "int8_pack: w must be an int8 [N, K] matrix");
  const at::Tensor wc = w.contiguous();
  const int64_t N = wc.size(0), K = wc.size(1), pairs = (K + 1) / 2, panels = (N + NR - 1) / NR;
  at::Tensor packed = at::zeros({panels, pairs, NR, 2}, wc.options().dtype(at::kShort));
  const int8_t* src = wc.const_data_ptr<int8_t>();
  int16_t* dst = packed.data_ptr<int16_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t panel = n / NR, lane = n % NR;
    for (int64_t k = 0; k < K; ++k) {
      const int8_t v = src[n * K + k];
      TORCH_CHECK(v != -128, "int8_pack: weight codes must be symmetric (-127..127), found -128");
      dst[((panel * pairs + k / 2) * NR + lane) * 2 + (k & 1)] = v;
    }
  }
  return packed;
}

// The whole activation as int32 pairs of int16, K block after K block ([kb][Mp][np], Mp = M rounded up
// to a multiple of `mr`, zeros in the padding), packed once per call and read by every piece of the
// GEMM. u8 input holds codes + 128 (oneDNN's form).
struct PackedA {
  std::vector<int32_t> buf;
  int64_t kc = 0, Mp = 0;
  const int32_t* block(int64_t p0) const { return buf.data() + Mp * p0; }   // K block starting at pair p0
};

template <typename T>
void pack_a(const T* a, int64_t M, int64_t K, int64_t kc, int64_t mr, PackedA& out) {
  const int64_t pairs = (K + 1) / 2;
  out.kc = kc;
  out.Mp = (M + mr - 1) / mr * mr;
  out.buf.assign(static_cast<size_t>(out.Mp * pairs), 0);
  for (int64_t p0 = 0; p0 < pairs; p0 += kc) {
    const int64_t np = std::min(kc, pairs - p0), k0 = 2 * p0, k1 = std::min(K, 2 * (p0 + np));
    int32_t* blk = out.buf.data() + out.Mp * p0;
    for (int64_t m = 0; m < M; ++m) {
      const T* row = a + m * K;
      int16_t* dst = reinterpret_cast<int16_t*>(blk + m * np);
      for (int64_t k = k0; k < k1; ++k) {
        if constexpr (std::is_same_v<T, uint8_t>) {
          dst[k - k0] = static_cast<int16_t>(static_cast<int16_t>(row[k]) - 128);
        } else {
          dst[k - k0] = row[k];
        }
      }
    }
  }
}

// The micro-kernels: C[MR, width] (+)= A[MR, np pairs] x panel[np pairs, width], int32. `acc_in`: add
// to what C holds (a later K block). `width` columns are written, of the panel's 16 (or 32).
void micro_portable(const int32_t* a, int64_t lda, const int16_t* b, int64_t ldb_panel, int64_t np, int64_t mr,
                    int64_t panels, int32_t* c, int64_t ldc, int64_t width, bool acc_in) {
  // panels: 1 or 2 adjacent NR-wide panels (ldb_panel int16 apart)
  for (int64_t r = 0; r < mr; ++r) {
    int32_t acc[2 * NR] = {0};
    const int16_t* ar = reinterpret_cast<const int16_t*>(a + r * lda);
    for (int64_t q = 0; q < panels; ++q) {
      const int16_t* bq = b + q * ldb_panel;
      for (int64_t p = 0; p < np; ++p) {
        const int32_t x0 = ar[2 * p], x1 = ar[2 * p + 1];
        const int16_t* bp = bq + p * NR * 2;
        for (int64_t j = 0; j < NR; ++j) acc[q * NR + j] += x0 * bp[2 * j] + x1 * bp[2 * j + 1];
      }
    }
    int32_t* cr = c + r * ldc;
    for (int64_t j = 0; j < width; ++j) cr[j] = acc_in ? cr[j] + acc[j] : acc[j];
  }
}

#if defined(__x86_64__)
// The accumulators are named variables, one per register: GCC spills an array of vectors to the
// stack at every step when only 16 registers exist (AVX2), which halved the kernel's speed.
#define LLMNPU_ROW(V, MADD, ADD, SET1, r)                          \
  {                                                                \
    const V x = SET1(a[(r) * lda + p]);                            \
    c##r##_0 = ADD(c##r##_0, MADD(x, b0));                         \
    c##r##_1 = ADD(c##r##_1, MADD(x, b1));                         \
  }
#define LLMNPU_STORE(STORE, r, lanes)                                            \
  if ((r) < mr) {                                                                \
    int32_t tile[2 * (lanes)];                                                   \
    STORE(tile, c##r##_0);                                                       \
    STORE(tile + (lanes), c##r##_1);                                             \
    int32_t* cr = c + (r) * ldc;                                                 \
    for (int64_t j = 0; j < width; ++j) cr[j] = acc_in ? cr[j] + tile[j] : tile[j]; \
  }

// AVX2: 6 rows x 16 columns (2 ymm of int32 per row): 12 accumulators, 2 weight vectors, 1 broadcast.
constexpr int64_t MR_AVX2 = 6;

__attribute__((target("avx2"))) inline void store_ymm(int32_t* t, __m256i v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), v);
}

__attribute__((target("avx2")))
void micro_avx2(const int32_t* a, int64_t lda, const int16_t* b, int64_t /*ldb_panel*/, int64_t np, int64_t mr,
                int64_t /*panels*/, int32_t* c, int64_t ldc, int64_t width, bool acc_in) {
  __m256i c0_0 = _mm256_setzero_si256(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0, c2_1 = c0_0;
  __m256i c3_0 = c0_0, c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0, c5_1 = c0_0;
  for (int64_t p = 0; p < np; ++p) {
    const __m256i b0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * NR * 2));
    const __m256i b1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + p * NR * 2 + 16));
#define ROW(r) LLMNPU_ROW(__m256i, _mm256_madd_epi16, _mm256_add_epi32, _mm256_set1_epi32, r)
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
  LLMNPU_STORE(store_ymm, 0, 8) LLMNPU_STORE(store_ymm, 1, 8) LLMNPU_STORE(store_ymm, 2, 8)
  LLMNPU_STORE(store_ymm, 3, 8) LLMNPU_STORE(store_ymm, 4, 8) LLMNPU_STORE(store_ymm, 5, 8)
}

// AVX-512BW: 12 rows x 32 columns (two adjacent 16-wide panels, 1 zmm each): 24 accumulators.
constexpr int64_t MR_AVX512 = 12;

__attribute__((target("avx512f,avx512bw"))) inline void store_zmm(int32_t* t, __m512i v) {
  _mm512_storeu_si512(t, v);
}

__attribute__((target("avx512f,avx512bw")))
void micro_avx512(const int32_t* a, int64_t lda, const int16_t* b, int64_t ldb_panel, int64_t np, int64_t mr,
                  int64_t panels, int32_t* c, int64_t ldc, int64_t width, bool acc_in) {
  __m512i c0_0 = _mm512_setzero_si512(), c0_1 = c0_0, c1_0 = c0_0, c1_1 = c0_0, c2_0 = c0_0, c2_1 = c0_0;
  __m512i c3_0 = c0_0, c3_1 = c0_0, c4_0 = c0_0, c4_1 = c0_0, c5_0 = c0_0, c5_1 = c0_0;
  __m512i c6_0 = c0_0, c6_1 = c0_0, c7_0 = c0_0, c7_1 = c0_0, c8_0 = c0_0, c8_1 = c0_0;
  __m512i c9_0 = c0_0, c9_1 = c0_0, c10_0 = c0_0, c10_1 = c0_0, c11_0 = c0_0, c11_1 = c0_0;
  const int16_t* b2 = panels > 1 ? b + ldb_panel : b;   // a lone last panel multiplies itself twice
  for (int64_t p = 0; p < np; ++p) {
    const __m512i b0 = _mm512_loadu_si512(b + p * NR * 2);
    const __m512i b1 = _mm512_loadu_si512(b2 + p * NR * 2);
#define ROW(r) LLMNPU_ROW(__m512i, _mm512_madd_epi16, _mm512_add_epi32, _mm512_set1_epi32, r)
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5) ROW(6) ROW(7) ROW(8) ROW(9) ROW(10) ROW(11)
#undef ROW
  }
  LLMNPU_STORE(store_zmm, 0, 16) LLMNPU_STORE(store_zmm, 1, 16) LLMNPU_STORE(store_zmm, 2, 16)
  LLMNPU_STORE(store_zmm, 3, 16) LLMNPU_STORE(store_zmm, 4, 16) LLMNPU_STORE(store_zmm, 5, 16)
  LLMNPU_STORE(store_zmm, 6, 16) LLMNPU_STORE(store_zmm, 7, 16) LLMNPU_STORE(store_zmm, 8, 16)
  LLMNPU_STORE(store_zmm, 9, 16) LLMNPU_STORE(store_zmm, 10, 16) LLMNPU_STORE(store_zmm, 11, 16)
}
#undef LLMNPU_ROW
#undef LLMNPU_STORE
#endif

using Micro = void (*)(const int32_t*, int64_t, const int16_t*, int64_t, int64_t, int64_t, int64_t, int32_t*,
                       int64_t, int64_t, bool);

struct Kernel {
  Micro fn;
  int64_t mr;       // rows per call
  int64_t panels;   // NR-wide panels per call
};

Kernel kernel_for(Isa isa) {
#if defined(__x86_64__)
  if (isa == Isa::avx2) return {micro_avx2, MR_AVX2, 1};
  if (isa == Isa::avx512) return {micro_avx512, MR_AVX512, 2};
#endif
  (void)isa;
  return {micro_portable, 4, 2};
}

// K pairs per block, the same for every block (so blocks are even): at most KC_PAIRS.
int64_t k_block(int64_t pairs) {
  const int64_t blocks = std::max<int64_t>(1, (pairs + KC_PAIRS - 1) / KC_PAIRS);
  return std::max<int64_t>(1, (pairs + blocks - 1) / blocks);
}

// C [M, N] int32 = A [M, K] x W^T for the panels [g0, g1) (in units of the kernel's panel group).
void gemm_range(const PackedA& a, int64_t M, int64_t K, const int16_t* w, int64_t N, int32_t* c, const Kernel& kern,
                int64_t g0, int64_t g1) {
  const int64_t pairs = (K + 1) / 2, panels = (N + NR - 1) / NR, panel_len = pairs * NR * 2;
  for (int64_t p0 = 0; p0 < pairs; p0 += a.kc) {
    const int64_t np = std::min(a.kc, pairs - p0);
    const int32_t* ablk = a.block(p0);
    for (int64_t m0 = 0; m0 < M; m0 += MC) {       // an MC-row slice of A stays in L2 across the panels
      const int64_t rows = std::min(MC, M - m0);
      for (int64_t g = g0; g < g1; ++g) {
        const int64_t panel = g * kern.panels, n0 = panel * NR;
        const int64_t here = std::min(kern.panels, panels - panel);
        const int64_t width = std::min(here * NR, N - n0);
        const int16_t* b = w + panel * panel_len + p0 * NR * 2;
        for (int64_t r = m0; r < m0 + rows; r += kern.mr) {
          kern.fn(ablk + r * np, np, b, panel_len, np, std::min(kern.mr, M - r), here, c + r * N + n0, N, width,
                  p0 > 0);
        }
      }
    }
  }
}

// out[m, n] = float(acc) * (w_scale[n] * x_scale) + bias[n], rounded step by step as
// `acc.float() * (w_scale * x_scale) + bias` in torch (this file is built with -ffp-contract=off)
void epilogue(const int32_t* acc, int64_t M, int64_t N, float x_scale, const float* w_scale, const float* bias,
              float* out) {
  std::vector<float> scale(static_cast<size_t>(N));
  for (int64_t n = 0; n < N; ++n) scale[n] = w_scale[n] * x_scale;
  llmnpu::parallel_pieces(M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) {
      const int32_t* ar = acc + m * N;
      float* o = out + m * N;
      for (int64_t n = 0; n < N; ++n) {
        const float v = static_cast<float>(ar[n]) * scale[n];
        o[n] = bias ? v + bias[n] : v;
      }
    }
  });
}

// a: int8 codes or uint8 (codes + 128) [M, K]; packed from int8_pack; n: W's rows. Without w_scale the
// int32 accumulator itself is returned (for exactness tests); with it, the float output.
at::Tensor int8_gemm(const at::Tensor& a, double x_scale, const at::Tensor& packed, int64_t n,
                     const std::optional<at::Tensor>& w_scale, const std::optional<at::Tensor>& bias,
                     const std::string& path) {
  const Isa isa = parse_isa(path);
  TORCH_CHECK(isa_supported(isa), "int8_gemm: this CPU cannot run the ", path, " path");
  TORCH_CHECK(a.dim() == 2 && (a.scalar_type() == at::kChar || a.scalar_type() == at::kByte),
              "int8_gemm: a must be an int8 or uint8 [M, K] matrix");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == at::kShort && packed.size(2) == NR,
              "int8_gemm: packed must come from int8_pack");
  const at::Tensor ac = a.contiguous();
  const int64_t M = ac.size(0), K = ac.size(1), pairs = (K + 1) / 2;
  TORCH_CHECK(packed.size(1) == pairs && packed.size(0) == (n + NR - 1) / NR,
              "int8_gemm: packed weight is for another shape than K = ", K, ", N = ", n);
  const Kernel kern = kernel_for(isa);
  at::Tensor acc = at::empty({M, n}, ac.options().dtype(at::kInt));
  const int64_t groups = ((n + NR - 1) / NR + kern.panels - 1) / kern.panels;
  const int16_t* w = packed.const_data_ptr<int16_t>();
  int32_t* c = acc.data_ptr<int32_t>();
  if (M > 0 && n > 0) {
    thread_local PackedA reused;  // a prefill calls this with the same few shapes
    PackedA& pa = reused;         // named here: a lambda run by a helper thread would see its own thread_local
    const int64_t kc = k_block(pairs);
    if (ac.scalar_type() == at::kByte) {
      pack_a(ac.const_data_ptr<uint8_t>(), M, K, kc, kern.mr, pa);
    } else {
      pack_a(ac.const_data_ptr<int8_t>(), M, K, kc, kern.mr, pa);
    }
    // ~16 pieces: small enough for a helper to share evenly, big enough to keep each panel's reuse
    llmnpu::parallel_pieces(groups, (groups + 15) / 16, [&](int64_t g0, int64_t g1) {
      gemm_range(pa, M, K, w, n, c, kern, g0, g1);
    });
  }
  if (!w_scale.has_value()) return acc;
  TORCH_CHECK(w_scale->scalar_type() == at::kFloat && w_scale->numel() == n,
              "int8_gemm: w_scale must be float32 with one entry per output channel");
  const at::Tensor ws = w_scale->contiguous();
  at::Tensor bc;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->numel() == n, "int8_gemm: bias must be float32 [N]");
    bc = bias->contiguous();
  }
  at::Tensor out = at::empty({M, n}, ac.options().dtype(at::kFloat));
  epilogue(c, M, n, static_cast<float>(x_scale), ws.const_data_ptr<float>(),
           bc.defined() ? bc.const_data_ptr<float>() : nullptr, out.data_ptr<float>());
  return out;
}

bool int8_path_supported(const std::string& path) { return isa_supported(parse_isa(path)); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(llmnpu_native, m) {
  m.def("int8_pack(Tensor w) -> Tensor");
  m.def("int8_gemm(Tensor a, float x_scale, Tensor packed, int n, Tensor? w_scale, Tensor? bias, str path) -> Tensor");
  m.def("int8_path_supported(str path) -> bool", &int8_path_supported);
}

TORCH_LIBRARY_IMPL(llmnpu_native, CPU, m) {
  m.impl("int8_pack", &int8_pack);
  m.impl("int8_gemm", &int8_gemm);
}
