// llmnpu_ops::chunk_attention_f32: one prefill chunk's attention in fp32, the CPU kernel of the
// exported program (op `llmnpu::chunk_attention.out`, attention_op.cpp).
//
// XNNPACK runs the decomposed form (grouped bmm, additive mask, softmax, bmm) near the core's fp32
// peak, but over every key of the chunk's [C, P + C] score block: the masked half of the causal
// diagonal and, at chunk ends, whole padded rows' worth of work. This kernel reads only the key tiles
// a block of queries can see, keeps that block's scores in L2 and skips the mask pass where the
// visible keys of a row are one contiguous run (causal and sliding-window masks).
#pragma once
#include <cstdint>

namespace llmnpu_ops {

struct AttentionShape {
  int64_t heads;      // H query heads
  int64_t kv_heads;   // KVH key/value heads (H % KVH == 0)
  int64_t rows;       // C queries
  int64_t keys;       // L keys (past and chunk)
  int64_t dim;        // d per head
};

// Whether the kernel takes this head size (a multiple of 16; others keep the decomposed form).
bool chunk_attention_supports(int64_t dim);

// q [H, C, d], k and v [KVH, L, d]; the mask is `keep` [C, L] (nonzero: attend) or `add` [C, L]
// (additive, -inf hides a key), the other null; out [C, H, d]. Rows that see no key are zero.
void chunk_attention_f32(const float* q, const float* k, const float* v, const uint8_t* keep,
                         const float* add, const AttentionShape& s, float scaling, float* out);

// The vector path taken on this CPU: "avx512", "avx2" or "baseline" (SSE2 or NEON).
// LLMNPU_OPS_ISA=avx2|baseline (or LLMNPU_CPU_ISA=avx2) caps it, so the tests run every path on one
// machine. The paths differ only in the last bits of the softmax's sum (and, on x86's baseline, which
// has no FMA, of every product).
const char* chunk_attention_isa();

}  // namespace llmnpu_ops
