"""The INT8 decode's outlier policy: one for the HF wrapper's decoder and the program's decode method.

A decode step quantizes each token's activation with the token's own scale, set by its largest
value; a handful of outliers (SmolLM2's down_proj inputs reach ~4,000x their p99.5) would leave
ordinary values a few of the 127 codes. So, per token and linear, the ``OUTLIERS`` largest-magnitude
inputs skip the activation's quantization: they are multiplied by the INT8 weight's own columns
(``outlier_rows``: W^T in int8 with the per-output-channel scales; 1 byte a weight), the rest go
through the dynamic INT8 GEMM. The weights are INT8 everywhere.

Chosen by measurement (``benchmarks/decode_accuracy.py``: 300 teacher-forced steps of calibration
text, SmolLM2-135M, logits against the float model's own decode): this policy 0.963 greedy agreement,
31.2 dB, +119 MiB of rows; the same with bf16 float rows 0.967, 32.7 dB, +238 MiB; keeping whole
linears float where calibration saw large outliers (17 of 210) 0.933, 26.1 dB, +57 MiB; no outliers
0.927, 24.6 dB; bf16 everywhere 0.983, 41.3 dB.
"""
from __future__ import annotations

from torch import Tensor

from .linear import quantize_weight

OUTLIERS = 16


def outliers_of(family, linear: str) -> int:
    """How many per-token outliers ``linear`` (a block-relative name such as ``self_attn.o_proj``, or
    ``lm_head``) takes out. The output projection's input (the attention output) has no outliers to
    speak of: alone in INT8 it keeps the logits at 42 dB against float, the others at 31-33 dB."""
    return 0 if linear == family.o else OUTLIERS


def outlier_rows(w: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``w`` [N, K] as the decode step's INT8 weight: (int8 [N, K], scales [N]) and its W^T rows
    (int8 [K, N], the same codes) for the outliers."""
    w_q, w_scale = quantize_weight(w, "channel")
    return w_q, w_scale, w_q.t().contiguous()
