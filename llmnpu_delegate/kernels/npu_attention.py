"""Chunk attention as an NPU graph computes it: the numerics every NPU form of it must match.

On an integer NPU every tensor between two ops carries a static encoding (a scale and a zero point
fixed at export, from calibration) and is rounded to it. Attention runs at 16-bit activations: an
8-bit softmax input cannot tell apart the scores that decide which keys a query reads. So:

- every 16-bit grid reaches ``HEADROOM`` times its layer's calibrated range;
- ``q`` (after RoPE) to 16 bits, unsigned on its layer's calibrated range; the K/V window to
  ``kv_bits`` (16, or 8 to halve the window's DRAM reads and memory), *signed symmetric* on its
  range: HTP's MatMul takes a 16-bit first operand only beside a symmetric second one
  (ExecuTorch's HTP rules for MatMul say the same);
- ``Q K^T * scaling`` exactly on those values (an integer product accumulates in 32 bits), then
  rounded to the scores' 16-bit encoding, whose range reaches ``MASK_DEPTH`` below the lowest
  calibrated score: the mask is an add that drives a hidden key to that floor (what a static graph
  with the mask as an input can do; no -inf on an integer grid), where softmax weighs it at most
  e^-MASK_DEPTH of the row's largest, below half of the probabilities' step for any window;
- softmax, its output to 16 bits over [0, 1];
- ``P V`` exactly, then rounded to the output's 16-bit encoding.

Unsigned encodings are QNN's asymmetric ones: ``q = clamp(round(x / scale) + zero, 0, 2^bits - 1)``
with ``scale = (max - min) / (2^bits - 1)`` and ``zero = round(-min / scale)`` over a range that
holds 0; signed symmetric ones have zero 0, codes within +-(2^(bits-1) - 1) and
``scale = max|x| / (2^(bits-1) - 1)``. Computed here in float32 on the rounded values: what an exact
integer pipeline gives, up to float32's rounding of the products' sums. ``lower/attention_method.py``
writes the same graph for HTP.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import LlmNpuError

KV_BITS = (8, 16)
ACT_BITS = 16
MASK_DEPTH = 32.0     # e^-32 ~ 1e-14: a hidden key's weight, even summed over a 64K-key window
# 16-bit grids reach this far beyond the calibrated range: text past it clamped the largest scores
# and outputs (a layer of the embedded model at 36 dB from float attention on held-apart calibration
# text; 63 with 1.5x, measured by benchmarks/attention_headroom.py), and 16 bits have resolution to
# spare. An 8-bit window has none: it keeps the calibrated range.
HEADROOM = 1.5


# 1.5 * 2^23: a float32 of magnitude below 2^22 plus this keeps no fraction bits, so (v + R) - R is v
# rounded half to even, exactly (every code of a 16-bit grid is below 2^16)
_ROUNDER = 12582912.0


@dataclass(frozen=True)
class Encoding:
    scale: float
    zero: int
    bits: int
    signed: bool = False        # symmetric: zero 0, codes within +-(2^(bits-1) - 1)

    @property
    def codes(self) -> tuple[int, int]:
        if self.signed:
            return -(2 ** (self.bits - 1) - 1), 2 ** (self.bits - 1) - 1
        return 0, 2 ** self.bits - 1

    @property
    def floor(self) -> float:
        """The lowest value on the grid."""
        return (self.codes[0] - self.zero) * self.scale

    @property
    def ceiling(self) -> float:
        """The highest value on the grid."""
        return (self.codes[1] - self.zero) * self.scale

    @classmethod
    def of_range(cls, lo: float, hi: float, bits: int) -> "Encoding":
        """The encoding of ``bits`` whose grid spans [lo, hi] widened to hold 0."""
        lo, hi = min(float(lo), 0.0), max(float(hi), 0.0)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise LlmNpuError(f"an encoding needs a finite range, got [{lo}, {hi}]")
        levels = 2 ** bits - 1
        scale = (hi - lo) / levels if hi > lo else 1.0
        return cls(scale, int(round(-lo / scale)), bits)

    @classmethod
    def symmetric(cls, absmax: float, bits: int) -> "Encoding":
        """The signed symmetric encoding of ``bits`` whose grid reaches +-``absmax``."""
        absmax = float(absmax)
        if not math.isfinite(absmax):
            raise LlmNpuError(f"an encoding needs a finite range, got +-{absmax}")
        return cls(absmax / (2 ** (bits - 1) - 1) if absmax > 0 else 1.0, 0, bits, signed=True)

    def round(self, x: Tensor) -> Tensor:
        """``x`` rounded to this encoding's grid (and clamped to its range), as float32: the code
        clamp(round(x / scale) + zero) less the zero point, times the scale. The bounds are integers,
        so clamping x / scale against them less the zero point before rounding gives the same values;
        the rounding (half to even) is then two float adds (``_ROUNDER``), which XNNPACK runs where a
        program traces this (it has no round op: a portable kernel between its delegates cost the
        cpu-int8 program under ``norms`` a fifth of its prefill)."""
        lo, hi = self.codes
        v = (x / self.scale).clamp_(lo - self.zero, hi - self.zero)
        return v.add_(_ROUNDER).sub_(_ROUNDER).mul_(self.scale)


@dataclass(frozen=True)
class AttentionEncodings:
    """One attention's static encodings: its query, K/V window, scores and output."""
    q: Encoding
    k: Encoding
    v: Encoding
    scores: Encoding
    out: Encoding

    @classmethod
    def of_ranges(cls, ranges: dict[str, tuple[float, float]], kv_bits: int = 16) -> "AttentionEncodings":
        if kv_bits not in KV_BITS:
            raise LlmNpuError(f"the K/V window is kept at {' or '.join(map(str, KV_BITS))} bits, got {kv_bits}")
        def wide(name: str, bits: int = ACT_BITS) -> tuple[float, float]:
            lo, hi = ranges[name]
            h = HEADROOM if bits == ACT_BITS else 1.0
            return min(lo, 0.0) * h, max(hi, 0.0) * h

        lo, hi = wide("scores")
        return cls(q=Encoding.of_range(*wide("q"), ACT_BITS),
                   k=Encoding.symmetric(max(map(abs, wide("k", kv_bits))), kv_bits),
                   v=Encoding.symmetric(max(map(abs, wide("v", kv_bits))), kv_bits),
                   scores=Encoding.of_range(lo - MASK_DEPTH, hi, ACT_BITS),
                   out=Encoding.of_range(*wide("out"), ACT_BITS))


PROBS = Encoding(1.0 / (2 ** ACT_BITS - 1), 0, ACT_BITS)     # softmax's output over [0, 1]


def npu_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, enc: AttentionEncodings) -> Tensor:
    """q [1, H, C, d], k/v [1, KVH, L, d], mask [.., C, L] (bool: attend, or additive float) ->
    [1, C, H, d], as ``kernels.attention.chunk_attention`` returns it."""
    _, h, c, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = h // kvh
    qr = enc.q.round(q.float()).reshape(kvh, g * c, d)
    kr, vr = enc.k.round(k[0].float()), enc.v.round(v[0].float())
    scores = enc.scores.round(torch.bmm(qr, kr.transpose(1, 2)) * scaling).view(kvh, g, c, length)
    m = mask.reshape(mask.shape[-2], length)
    # the mask's add: a hidden key's score clamps to the grid's floor, an open one is unchanged
    scores = enc.scores.round(scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m)
    probs = PROBS.round(torch.softmax(scores.reshape(kvh, g * c, length), dim=-1))
    out = enc.out.round(torch.bmm(probs, vr)).view(1, h, c, d)
    return out.transpose(1, 2).contiguous()


class NpuAttention(torch.nn.Module):
    """``chunk_attention``'s call form (q, k, v, mask, scaling, softcap) with one layer's encodings."""

    def __init__(self, enc: AttentionEncodings):
        super().__init__()
        self.enc = enc

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, softcap: float) -> Tensor:
        if softcap:
            raise LlmNpuError("attention with logit softcapping (Gemma-2) has no NPU form here: keep attention on "
                              "the CPU (a placement without 'attention')")
        return npu_attention(q, k, v, mask, scaling, self.enc)


def attention_ranges(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float, out: Tensor) -> dict:
    """The ranges one call of float attention shows (scores over the positions its mask allows)."""
    _, h, c, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    g = h // kvh
    scores = torch.bmm(q.float().reshape(kvh, g * c, d), k[0].float().transpose(1, 2)).mul_(scaling)
    m = mask.reshape(mask.shape[-2], length)
    allowed = m if m.dtype == torch.bool else torch.isfinite(m)
    seen = scores.view(kvh, g, c, length)[:, :, allowed]
    return {name: (float(t.min()), float(t.max())) for name, t in
            (("q", q), ("k", k), ("v", v), ("scores", seen), ("out", out))}


def widen(a: dict | None, b: dict) -> dict:
    """The union of two ranges dicts (``attention_ranges``)."""
    if a is None:
        return dict(b)
    return {name: (min(a[name][0], b[name][0]), max(a[name][1], b[name][1])) for name in b}
