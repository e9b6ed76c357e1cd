// The body of chunk_attention_f32 for one vector width, included once per ISA by attention.cpp
// (which sets LLMNPU_NS, LLMNPU_W floats per vector and LLMNPU_R rows per tile under a target
// pragma). GCC vector extensions, no intrinsics: the same code is AVX-512, AVX2, SSE2 or NEON. No
// std templates in here: their instances would be shared across the ISA copies by the linker.
//
// Sums run in one order on every path: a score sums over the head dimension in index order, an
// output over the keys in index order; only the softmax's sum of exponentials is taken per lane,
// so paths of different widths differ in its last bits.
namespace LLMNPU_NS {

constexpr int W = LLMNPU_W;
constexpr int NV = 4;               // vectors per tile strip
constexpr int R = LLMNPU_R;         // rows per tile: R x NV accumulators fit the register file
constexpr int64_t STRIP = NV * W;   // columns per tile
typedef float vf __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
typedef uint8_t vb __attribute__((vector_size(W)));

inline vf load(const float* p) { vf x; __builtin_memcpy(&x, p, sizeof x); return x; }
inline void store(float* p, vf x) { __builtin_memcpy(p, &x, sizeof x); }
inline vf splat(float a) { return vf{} + a; }

// c[r][0:Nv * W] = sum over k in order of a[r][k] * b[k][0:Nv * W], for Rows rows
template <int Rows, int Nv>
inline void tile(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c, int64_t ldc) {
  vf acc[Rows][Nv];
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Nv; ++j) acc[r][j] = vf{};
  for (int64_t k = 0; k < depth; ++k) {
    vf bv[Nv];
    for (int j = 0; j < Nv; ++j) bv[j] = load(b + k * ldb + j * W);
    for (int r = 0; r < Rows; ++r) {
      const vf av = splat(a[r * lda + k]);
      for (int j = 0; j < Nv; ++j) acc[r][j] += av * bv[j];
    }
  }
  for (int r = 0; r < Rows; ++r)
    for (int j = 0; j < Nv; ++j) store(c + r * ldc + j * W, acc[r][j]);
}

// the tiles of `rows` rows (R at a time, then the rest) for one strip of Nv vectors
template <int Nv, int Rows = R>
inline void tiles(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c, int64_t ldc,
                  int64_t rows) {
  if constexpr (Rows > 0) {
    for (; rows >= Rows; rows -= Rows, a += Rows * lda, c += Rows * ldc) tile<Rows, Nv>(a, lda, b, ldb, depth, c, ldc);
    if (rows > 0) tiles<Nv, Rows - 1>(a, lda, b, ldb, depth, c, ldc, rows);
  }
}

// c[rows, cols] = a[rows, depth] b[depth, cols], cols a multiple of W: strips of NV vectors, then one
// narrower strip
inline void product(const float* a, int64_t lda, const float* b, int64_t ldb, int64_t depth, float* c, int64_t ldc,
                    int64_t rows, int64_t cols) {
  int64_t e = 0;
  for (; e + STRIP <= cols; e += STRIP) tiles<NV>(a, lda, b + e, ldb, depth, c + e, ldc, rows);
  switch ((cols - e) / W) {
    case 1: return tiles<1>(a, lda, b + e, ldb, depth, c + e, ldc, rows);
    case 2: return tiles<2>(a, lda, b + e, ldb, depth, c + e, ldc, rows);
    case 3: return tiles<3>(a, lda, b + e, ldb, depth, c + e, ldc, rows);
    default: return;
  }
}

// exp(x) for x <= 0 (lanes below -87 give ~0; masked lanes are zeroed by the caller): 2^n * p(r)
// with r = x - n ln2, p a degree-6 polynomial (relative error ~2e-7)
inline vf vexp(vf x) {
  x = x < splat(-87.0f) ? splat(-87.0f) : x;
  const vf magic = splat(12582912.0f);   // 1.5 * 2^23: adding it rounds to an integer
  const vf n = (x * splat(1.44269504f) + magic) - magic;
  vf r = x - n * splat(0.693145752f);
  r = r - n * splat(1.42860677e-06f);
  vf p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  const vi e = (__builtin_convertvector(n, vi) + 127) << 23;
  vf scale;
  __builtin_memcpy(&scale, &e, sizeof scale);
  return p * scale;
}

// One row's scores s[0, width) (all visible when `dense`, else per keep/add) to unnormalised
// probabilities in place; returns their sum (0 when nothing is visible). Width is a multiple of W.
inline float softmax_row(float* s, int64_t width, int64_t lo, int64_t hi, const uint8_t* keep, const float* add) {
  const float ninf = -__builtin_inff();
  // hide what lies outside [lo, hi) and what the mask hides inside it
  for (int64_t j = 0; j < lo; ++j) s[j] = ninf;
  for (int64_t j = hi; j < width; ++j) s[j] = ninf;
  if (add) {
    for (int64_t j = lo; j < hi; ++j) s[j] += add[j];
  } else if (keep) {
    for (int64_t j = lo; j < hi; ++j)
      if (!keep[j]) s[j] = ninf;
  }
  vf m = splat(ninf);
  for (int64_t j = 0; j < width; j += W) {
    const vf x = load(s + j);
    m = x > m ? x : m;
  }
  float mx = m[0];
  for (int i = 1; i < W; ++i) mx = m[i] > mx ? m[i] : mx;
  if (mx == ninf) {
    for (int64_t j = 0; j < width; ++j) s[j] = 0.0f;
    return 0.0f;
  }
  vf sum = vf{};
  const vf vmx = splat(mx), zero = vf{}, vninf = splat(ninf);
  for (int64_t j = 0; j < width; j += W) {
    const vf x = load(s + j);
    const vf p = x == vninf ? zero : vexp(x - vmx);
    store(s + j, p);
    sum += p;
  }
  float total = 0.0f;
  for (int i = 0; i < W; ++i) total += sum[i];
  return total;
}

// Scratch: kt [Lp * d] (K of one head transposed, Lp = L rounded up to STRIP, zero-padded), qb
// [block rows, d], sc [block rows, Lp], ob [block rows, d]. lo/hi: each query's visible key range,
// dense: whether every key inside it is visible.
inline void attend(const float* q, const float* k, const float* v, const uint8_t* keep, const float* add,
                   const llmnpu_ops::AttentionShape& s, float scaling, float* out, const int64_t* lo,
                   const int64_t* hi, const uint8_t* dense, int64_t block_positions, float* kt, float* qb,
                   float* sc, float* ob) {
  const int64_t H = s.heads, KVH = s.kv_heads, C = s.rows, L = s.keys, d = s.dim, g = H / KVH;
  const int64_t Lp = (L + STRIP - 1) / STRIP * STRIP;
  for (int64_t kh = 0; kh < KVH; ++kh) {
    const float* kh_k = k + kh * L * d;
    const float* kh_v = v + kh * L * d;
    // K transposed, strip by strip ([Lp / STRIP][d][STRIP]): a tile reads one contiguous block
    for (int64_t j = 0; j < Lp; ++j) {
      float* col = kt + (j / STRIP) * d * STRIP + j % STRIP;
      if (j < L)
        for (int64_t e = 0; e < d; ++e) col[e * STRIP] = kh_k[j * d + e];
      else
        for (int64_t e = 0; e < d; ++e) col[e * STRIP] = 0.0f;
    }
    for (int64_t c0 = 0; c0 < C; c0 += block_positions) {
      const int64_t c1 = c0 + block_positions < C ? c0 + block_positions : C;
      const int64_t rows = (c1 - c0) * g;   // row (c - c0) * g + head-in-group: positions outer
      int64_t klo = L, khi = 0;
      for (int64_t c = c0; c < c1; ++c)
        if (hi[c] > lo[c]) {
          klo = lo[c] < klo ? lo[c] : klo;
          khi = hi[c] > khi ? hi[c] : khi;
        }
      if (khi <= klo) {   // no query of the block sees a key
        for (int64_t c = c0; c < c1; ++c)
          for (int64_t i = 0; i < g; ++i)
            for (int64_t e = 0; e < d; ++e) out[(c * H + kh * g + i) * d + e] = 0.0f;
        continue;
      }
      const int64_t k0 = klo / STRIP * STRIP, k1 = (khi + STRIP - 1) / STRIP * STRIP, width = k1 - k0;
      for (int64_t c = c0; c < c1; ++c)
        for (int64_t i = 0; i < g; ++i) {
          const float* src = q + ((kh * g + i) * C + c) * d;
          float* dst = qb + ((c - c0) * g + i) * d;
          for (int64_t e = 0; e < d; ++e) dst[e] = src[e] * scaling;
        }
      for (int64_t j0 = k0; j0 < k1; j0 += STRIP) tiles<NV>(qb, d, kt + j0 * d, STRIP, d, sc + (j0 - k0), width, rows);
      float inv[256];   // block rows <= 256 (attention.cpp sizes the blocks)
      int64_t p0 = width, p1 = 0;   // the keys some row of the block attends to
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t c = c0 + r / g;
        const int64_t a = hi[c] > lo[c] ? lo[c] - k0 : 0, b = hi[c] > lo[c] ? hi[c] - k0 : 0;
        const int64_t off = c * L + k0;
        const float total = softmax_row(sc + r * width, width, a, b, dense[c] || !keep ? nullptr : keep + off,
                                        add ? add + off : nullptr);
        inv[r] = total > 0.0f ? 1.0f / total : 0.0f;
        if (b > a) {
          p0 = a < p0 ? a : p0;
          p1 = b > p1 ? b : p1;
        }
      }
      product(sc + p0, width, kh_v + (k0 + p0) * d, d, p1 - p0, ob, d, rows, d);
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t c = c0 + r / g, h = kh * g + r % g;
        const vf scale = splat(inv[r]);
        for (int64_t e = 0; e < d; e += W) store(out + (c * H + h) * d + e, load(ob + r * d + e) * scale);
      }
    }
  }
}

}  // namespace LLMNPU_NS
