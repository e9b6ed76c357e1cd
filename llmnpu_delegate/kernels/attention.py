"""Chunk attention: the float, position-dependent ("dynamic") work of a prefill chunk, on the CPU.

A chunk of C queries at positions P..P+C-1 attends to the P+C keys of the previous chunks and
itself, under a mask (causal, and a sliding window for some layers). PyTorch's fused CPU SDPA
(blocked, grouped-query aware, no [C, P+C] score tensor per head) is the fastest path here: 8 ms
against 16-19 ms for explicit bmm + softmax on Qwen2-0.5B shapes at P+C=768, one thread. Gemma-2's
logit softcapping needs the scores themselves, so that case runs the explicit path, which stacks
the ``g`` query heads sharing a K/V head into one matrix instead of copying K/V per head.

Precision: the engine's quantized modes run attention with bf16 operands and fp32 accumulation and
softmax (``chunk_attention_bf16``, a native kernel, 3.5-4x fused fp32 SDPA on this CPU; the logits of
the embedded model stay 48 dB from fp32 attention). The float mode keeps fp32: it is the reference.
"""
from __future__ import annotations


import torch
import torch.nn.functional as F
from torch import Tensor

from ..errors import LlmNpuError
from . import native_ops

PRECISIONS = ("auto", "fp32", "bf16")


def causal_mask(q_len: int, kv_len: int) -> Tensor:
    """[1, 1, q_len, kv_len] bool: query i (at position kv_len - q_len + i) sees keys <= its position."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    return (torch.arange(kv_len)[None, :] <= q_pos)[None, None]


def _explicit(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float,
              inplace: bool = True) -> Tensor:
    # In place by default (no [KVH, g*C, L] temporaries); ``inplace=False`` for graph decompositions,
    # which must be functional.
    _, h, c, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = h // kvh
    scores = torch.bmm(q.reshape(kvh, g * c, d), k[0].transpose(1, 2))
    if inplace:
        scores.mul_(scaling)
        if softcap > 0:
            scores.div_(softcap).tanh_().mul_(softcap)
    else:
        scores = scores * scaling
        if softcap > 0:
            scores = torch.tanh(scores / softcap) * softcap
    s4 = scores.view(kvh, g, c, length)
    m = mask.reshape(mask.shape[-2], length)
    if m.dtype == torch.bool:
        s4 = s4.masked_fill_(~m, float("-inf")) if inplace else s4.masked_fill(~m, float("-inf"))
    else:
        s4 = s4.add_(m) if inplace else s4 + m
    probs = torch.softmax(s4.reshape(kvh, g * c, length), dim=-1)
    return torch.bmm(probs, v[0]).view(1, h, c, d)


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float,
            inplace: bool = True) -> Tensor:
    torch._check(q.shape[0] == 1, lambda: "chunk attention runs one sequence at a time (batch 1)")
    if softcap > 0:
        out = _explicit(q, k, v, mask, scaling, softcap, inplace)
    else:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=True)
    return out.transpose(1, 2).contiguous()   # [1, C, H, d], as transformers' attention returns


@torch.library.custom_op("llmnpu::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float) -> Tensor:
    """q [1, H, C, d], k/v [1, KVH, L, d], mask [.., C, L] (bool: attend, or additive float) -> [1, C, H, d]."""
    return _attend(q, k, v, mask, scaling, softcap)


@chunk_attention.register_fake
def _(q, k, v, mask, scaling, softcap):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


# The out variant ExecuTorch's emitter turns a kept ``chunk_attention`` into; its runtime kernel is
# the program's own (runner/ops/, loaded by both runners), not this Python one.
_out_lib = torch.library.Library("llmnpu", "FRAGMENT")
_out_lib.define("chunk_attention.out(Tensor q, Tensor k, Tensor v, Tensor mask, float scaling, float softcap, *, "
                "Tensor(a!) out) -> Tensor(a!)")


@torch.library.impl(_out_lib, "chunk_attention.out", "CompositeExplicitAutograd")
def _chunk_attention_out(q, k, v, mask, scaling, softcap, *, out):
    out.copy_(_attend(q, k, v, mask, scaling, softcap))
    return out


@torch.library.impl(_out_lib, "chunk_attention.out", "Meta")
def _chunk_attention_out_meta(q, k, v, mask, scaling, softcap, *, out):
    return out


def program_kernel_takes(q_shape, mask_shape, softcap: float) -> bool:
    """Whether the program's kernel (runner/ops/attention.h) runs this attention: batch 1, a head size
    that is a multiple of 16, one mask for all heads, no softcapping. Others are decomposed."""
    c, d = q_shape[2], q_shape[3]
    return (q_shape[0] == 1 and softcap == 0 and isinstance(d, int) and d % 16 == 0
            and len(mask_shape) >= 2 and all(s == 1 for s in mask_shape[:-2]) and mask_shape[-2] == c)


def chunk_attention_bf16(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float) -> Tensor:
    """``chunk_attention`` with bf16 operands (see the module docstring). Softcapping and per-head
    masks, which the native kernel does not take, run the fp32 path."""
    if softcap > 0 or q.shape[0] != 1 or mask.numel() != mask.shape[-2] * mask.shape[-1]:
        return _attend(q, k, v, mask, scaling, softcap)
    return native_ops.chunk_attention_bf16(q, k, v, mask, scaling)


def resolve_precision(precision: str, quantized: bool) -> str:
    """``"fp32"`` or ``"bf16"`` for an engine: ``"auto"`` is bf16 for the quantized modes when the native
    kernel runs here, else fp32 (the float mode is the reference and stays fp32)."""
    if precision not in PRECISIONS:
        raise LlmNpuError(f"unknown attention precision '{precision}': use one of {', '.join(PRECISIONS)}")
    if precision == "auto":
        return "bf16" if quantized and native_ops.bf16_attention_available() else "fp32"
    if precision == "bf16" and not native_ops.bf16_attention_available():
        raise LlmNpuError("bf16 attention needs the native kernels (`make kernels`) and a CPU with AVX-512 BF16: "
                          "use attention='fp32' here")
    return precision


def _exported(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float) -> Tensor:
    # Grouped bmm and an additive mask: ops XNNPACK takes whole. Measured for one SmolLM2 layer at a
    # chunk of 256 over 1,024 keys, one thread, in an ExecuTorch method: 6.1 ms, against 21.7 ms for
    # decomposed SDPA (K/V copied per query head) and 16.9 ms with a boolean mask (``where`` stays on
    # the portable kernels, a pass over every score); torch's fused SDPA: 7.5-7.9 ms.
    if mask.dtype == torch.bool:
        mask = torch.where(mask, 0.0, float("-inf"))
    return _explicit(q, k, v, mask, scaling, softcap, inplace=False).transpose(1, 2).contiguous()


def decompositions(keep_attention: bool = False) -> dict:
    """``llmnpu::chunk_attention`` as plain aten ops, for ``ExportedProgram.run_decompositions``, unless
    ``keep_attention``: then the op stays, for the program's own kernel (``program_kernel_takes``)."""
    return {} if keep_attention else {torch.ops.llmnpu.chunk_attention.default: _exported}
