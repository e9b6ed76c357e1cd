"""The quantized linear that replaces nn.Linear inside decoder blocks, and its tensor math."""
from __future__ import annotations

import torch
from torch import Tensor, nn

from .. import kernels as K
from ..format.rows import RowStore
from ..kernels.ops import quantize_weight  # noqa: F401  (lives with the kernels: the rows file uses it too)


class QuantLinear(nn.Module):
    """W8A8 linear: a static per-tensor activation scale, INT8 weights, optional shadow path.

    In shadow mode the activation scale is ``clip / 127``: quantization saturates at ``clip`` and
    the float path adds ``(x - clip(x)) @ W^T`` for the input channels that went beyond it.
    ``pruned`` turns the shadow path off and switches to ``full_scale`` (absolute maximum / 127),
    so a pruned layer loses resolution, never values.
    """

    def __init__(self, weight_q: Tensor, weight_scale: Tensor, bias: Tensor | None, act_scale: float,
                 full_scale: float, clip: float | None = None, shadow: RowStore | None = None,
                 smooth: Tensor | None = None):
        super().__init__()
        self.out_features, self.in_features = weight_q.shape
        self.register_buffer("weight_q", weight_q.contiguous())
        self.register_buffer("weight_scale", weight_scale.float().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())
        self.register_buffer("smooth", smooth)  # [K] divisor of x (SmoothQuant), or None
        self.act_scale = float(act_scale)
        self.full_scale = float(full_scale)
        self.clip = clip
        self.shadow = shadow
        self.pruned = shadow is None
        # the input channels whose residues the shadow product takes, None for all: a static set, as
        # an NPU graph holds it (placement piece ``peak``); the others' residues are dropped
        self.shadow_channels: Tensor | None = None
        # what the NPU does to the integer product before the CPU adds the shadow path: nothing in the
        # engine (float outputs); an exported program's 8-bit output encodings (lower/program_numerics.py)
        self.output_stage = None
        # the shadow product as an exported program's NPU graph computes it, in place of the CPU's
        # (a QNN program's peak product on its 16-bit grids: lower/program_numerics.py), or None
        self.npu_shadow = None
        self.outlier_elements = 0   # activation elements that took the shadow path
        self.saturated_elements = 0  # elements beyond the full range (unseen in calibration): clipped
        self.seen_elements = 0

    def forward(self, x: Tensor) -> Tensor:
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features).float()          # [M, K]
        if self.smooth is not None:
            x2 = x2 / self.smooth
        shadow = self.shadow is not None and not self.pruned
        scale = self.act_scale if shadow else self.full_scale
        y = K.w8a8_linear(x2, scale, self.weight_q, self.weight_scale, self.bias)   # [M, N]
        if self.output_stage is not None:
            y = self.output_stage(y)
        self.seen_elements += x2.numel()
        if not shadow:
            # A static full-range scale can still meet a value larger than any in calibration; it
            # saturates. Count it, so that "never clips" is a measured claim, not an assumption.
            lo, hi = torch.aminmax(x2)
            limit = scale * K.QMAX
            if max(-float(lo), float(hi)) > limit:
                self.saturated_elements += int((x2.abs() > limit).sum())
        if shadow and self.npu_shadow is not None:
            self.outlier_elements += int((x2[:, self.npu_shadow.channels].abs() > self.clip).sum())
            y = y.float() + self.npu_shadow(x2)
        elif shadow:     # merged into y as it is computed, as the engine's fused CPU subgraphs do
            y = y.contiguous().float()
            if self.shadow_channels is not None:
                kept = x2[:, self.shadow_channels]
                x2 = x2.clamp(-self.clip, self.clip)
                x2[:, self.shadow_channels] = kept
            self.outlier_elements += self.shadow.add_product_(y, x2, self.clip)
        return y.reshape(*lead, self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        mode = "full range" if self.pruned else f"shadow clip={self.clip:.4g}"
        if self.smooth is not None:
            mode = "smooth"
        scale = self.full_scale if self.pruned else self.act_scale
        return f"in={self.in_features}, out={self.out_features}, act_scale={scale:.4g}, {mode}"
