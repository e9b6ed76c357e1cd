"""Signal-to-quantization-noise ratio: how every accuracy figure of the project compares two tensors."""
from __future__ import annotations

import torch
from torch import Tensor


def sqnr_db(x: Tensor, ref: Tensor) -> float:
    """10 log10(|ref|^2 / |x - ref|^2) in float64; infinite when ``x`` is ``ref``."""
    noise = (x.double() - ref.double()).pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))
