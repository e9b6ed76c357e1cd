"""RMSNorm as an integer NPU graph computes it: the numerics every NPU form of it must match.

A norm placed on the NPU reads the residual stream, whose few outlier channels (~25,000 on the
embedded model, one-signed) no 8-bit encoding holds beside a bulk near 1. Its activations are 16-bit,
as HTP's RmsNorm takes them (ExecuTorch annotates it 16a16w):

- ``x`` to 16 bits, unsigned on its norm's calibrated range widened by ``HEADROOM`` (asymmetric: the
  outliers lie on one side, a symmetric grid would waste half its codes);
- the weight to 16 bits, unsigned on its own range;
- ``x * rsqrt(mean(x^2) + eps) * weight`` on those values in float32 (HTP's accumulation is wider
  than the grid: measured within a step of this on the simulator);
- the result to 16 bits, unsigned on its calibrated range widened by ``HEADROOM``.

Encodings are ``npu_attention.Encoding``'s (QNN's asymmetric ones). ``lower/norm_method.py`` writes
the same graph for HTP.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from .npu_attention import ACT_BITS, Encoding

# The stream's range moves from text to text; clamping an outlier channel changes every bulk value
# after the norm. Less headroom keeps a finer grid: on the embedded model's evaluation text the
# logits stay within ~1 dB of the unwidened grid's up to 1.5x.
HEADROOM = 1.25


@dataclass(frozen=True)
class NormEncodings:
    """One norm's static encodings: its input, weight and output."""
    x: Encoding
    weight: Encoding
    out: Encoding

    @classmethod
    def of_ranges(cls, ranges: dict[str, tuple[float, float]], weight: Tensor) -> "NormEncodings":
        w = weight.detach().float()
        return cls(x=Encoding.of_range(*(v * HEADROOM for v in ranges["x"]), ACT_BITS),
                   weight=Encoding.of_range(float(w.min()), float(w.max()), ACT_BITS),
                   out=Encoding.of_range(*(v * HEADROOM for v in ranges["out"]), ACT_BITS))


def npu_rms_norm(x: Tensor, weight: Tensor, eps: float, enc: NormEncodings) -> Tensor:
    """RMSNorm over the last dim of ``x`` at ``enc``'s encodings, as float32."""
    normed = F.rms_norm(enc.x.round(x.float()), (x.shape[-1],), enc.weight.round(weight.float()), eps)
    return enc.out.round(normed)


class NpuNorm(torch.nn.Module):
    """``native_ops.rms_norm``'s call form (x, weight, eps) with one norm's encodings."""

    def __init__(self, enc: NormEncodings):
        super().__init__()
        self.enc = enc

    def forward(self, x: Tensor, weight: Tensor, eps: float) -> Tensor:
        return npu_rms_norm(x, weight, eps, self.enc)


def norm_ranges(x: Tensor, out: Tensor) -> dict:
    """The ranges one call of a float norm shows."""
    return {"x": (float(x.min()), float(x.max())), "out": (float(out.min()), float(out.max()))}


def norm_key(path: str) -> tuple[int, str] | None:
    """A decoder block's norm by module path (``model.layers.3.input_layernorm``, or an exported
    node's ``nn_module_stack`` path, ``model.model.layers.3...``): (3, "input_layernorm"); None
    outside the blocks."""
    parts = path.split(".")
    for a, b in zip(parts, parts[1:]):
        if a == "layers" and b.isdigit():
            return int(b), path.split(".")[-1]
    return None
