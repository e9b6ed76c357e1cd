"""Chunk attention: the float, position-dependent ("dynamic") work of a prefill chunk, on the CPU.

A chunk of C queries at positions P..P+C-1 attends to the P+C keys of the previous chunks and
itself. Grouped-query attention is computed without copying K/V per query head: the ``g`` query
heads that share a K/V head are stacked into one [g*C, d] matrix, so one ``bmm`` per K/V head does
the work (explicit bmm + softmax runs ~2x faster than fp32 SDPA on one thread here).

``workspace`` (optional) is a preallocated [kv_heads, g*C, P+C] float buffer for the scores: the
per-position attention graphs of the runtime own one each, so no large temporary is allocated per
call (large fresh allocations page-fault on every call with glibc).
"""
from __future__ import annotations

import torch
from torch import Tensor


def causal_mask(q_len: int, kv_len: int) -> Tensor:
    """[1, 1, q_len, kv_len] bool: query i (at position kv_len - q_len + i) sees keys <= its position."""
    q_pos = torch.arange(kv_len - q_len, kv_len)[:, None]
    return (torch.arange(kv_len)[None, :] <= q_pos)[None, None]


def _attend(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float,
            scores: Tensor | None) -> Tensor:
    b, h, c, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    torch._check(b == 1, lambda: "chunk attention runs one sequence at a time (batch 1)")
    g = h // kvh
    qs = q.reshape(kvh, g * c, d)
    if scores is None:
        scores = torch.empty(kvh, g * c, length, dtype=q.dtype)
    torch.bmm(qs, k[0].transpose(1, 2), out=scores)
    scores.mul_(scaling)
    if softcap > 0:
        scores.div_(softcap).tanh_().mul_(softcap)
    s4 = scores.view(kvh, g, c, length)
    m = mask.reshape(mask.shape[-2], length)
    if m.dtype == torch.bool:
        s4.masked_fill_(~m, float("-inf"))
    else:
        s4.add_(m)
    # In-place softmax: no [kvh, g*C, L] temporary besides the scores themselves.
    scores.sub_(scores.amax(dim=-1, keepdim=True))
    scores.exp_()
    scores.div_(scores.sum(dim=-1, keepdim=True))
    out = torch.bmm(scores, v[0])                      # [kvh, g*C, d]
    return out.view(1, h, c, d).transpose(1, 2).contiguous()   # [1, C, H, d], as HF expects


@torch.library.custom_op("llmnpu::chunk_attention", mutates_args=())
def chunk_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float) -> Tensor:
    """q [1, H, C, d], k/v [1, KVH, L, d], mask [.., C, L] (bool: attend, or additive float) -> [1, C, H, d]."""
    return _attend(q, k, v, mask, scaling, softcap, None)


@chunk_attention.register_fake
def _(q, k, v, mask, scaling, softcap):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))


@torch.library.custom_op("llmnpu::chunk_attention_ws", mutates_args=("workspace",))
def chunk_attention_ws(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float,
                       workspace: Tensor) -> Tensor:
    """``chunk_attention`` writing its scores into ``workspace`` [KVH, g*C, L] (same result)."""
    return _attend(q, k, v, mask, scaling, softcap, workspace)


@chunk_attention_ws.register_fake
def _(q, k, v, mask, scaling, softcap, workspace):
    return q.new_empty((q.shape[0], q.shape[2], q.shape[1], q.shape[3]))
