"""The INT8 decode's outlier policy: per token for the HF wrapper's decoder (``runtime/hf_decoder.py``)
and its native step; per linear for the program's ``decode`` method (``lower/decode_method.py``).

A decode step quantizes each token's activation with the token's own scale, set by its largest
value; a handful of outliers (SmolLM2's down_proj inputs reach ~4,000x their p99.5) would leave
ordinary values a few of the 127 codes. So, per token and linear, the ``OUTLIERS`` largest-magnitude
inputs skip the activation's quantization and go through float rows of W^T (``outlier_rows``: bf16,
2 bytes a weight); the rest go through the dynamic INT8 GEMM.

Chosen by measurement on an Intel Xeon (AMX class), SmolLM2-135M (``benchmarks/decode_accuracy.py
--outliers 0 16 --policies``: 300 teacher-forced steps of calibration text, logits against the
float model's own decode):

    policy                                         SQNR     agreement  extra memory
    16 outliers through bf16 rows (this one)       33.0 dB  0.967      238 MiB
    16 outliers through the INT8 weight's codes    31.3 dB  0.950      119 MiB
    linears kept float where calibration saw
      large outliers (17 of 210; lower/decode_method.py)  26.1 dB  0.933       57 MiB
    no outliers                                    24.3 dB  0.917        0
    every linear bf16 (reference)                  41.3 dB  0.983

The INT8 codes' rows also fell below the gate test's 0.95 teacher-forced decode agreement on its
six chat prompts (0.948; tests/test_generate_smollm2.py), so the bf16 rows stay.

The program's ``decode`` method cannot pick outliers per token: a per-token top-k is not an XNNPACK
operator, and lowered as portable ``topk``/``gather``/``scatter`` between the delegated linears it
split the step into hundreds of partitions (the embedded model's export ran past 15 minutes). Its
outliers sit in the same few channels token after token, though, so the program fixes them: in the
linears where calibration saw inputs whose maximum exceeds ``OUTLIER_RATIO`` x their clip percentile
(ordinary values would get fewer than 8 of the 127 codes; 17 of 210 linears on SmolLM2-135M, 15 of
them down_proj), the ``HOT_INPUTS`` channels with the largest calibrated maximum go through float
rows and the rest through the dynamic INT8 GEMM (``hot_inputs``). Measured as above (AMD EPYC Zen 4):

    16 calibrated channels through float rows      25.9 dB  0.940       0.7 MiB
    the same 17 linears kept whole in float         25.5 dB  0.943      57 MiB (the form before)
    4 calibrated channels                          25.5 dB  0.930       0.2 MiB
    16 calibrated channels in every linear         27.2 dB  0.943       8.4 MiB
    clamped at the prefill's clip, the residue
      through a second dynamic INT8 GEMM           27.9 dB  0.940       0   (2x the step's GEMM work)
    the same, the residue through float W^T        28.4 dB  0.937     367 MiB

So no per-linear form found yet reaches the per-token topk (32.8 dB, 0.967 on that run): a clip set
for the prefill's static scale leaves the token's own scale coarser than taking its 16 largest out.
"""
from __future__ import annotations

import torch
from torch import Tensor

OUTLIERS = 16
OUTLIER_RATIO = 16.0
HOT_INPUTS = 16


def outliers_of(family, linear: str) -> int:
    """How many per-token outliers ``linear`` (a block-relative name such as ``self_attn.o_proj``, or
    ``lm_head``) takes out. The output projection's input (the attention output) has no outliers to
    speak of: alone in INT8 it keeps the logits at 42 dB against float, the others at 31-33 dB."""
    return 0 if linear == family.o else OUTLIERS


def outlier_rows(w: Tensor) -> Tensor:
    """The float rows the outliers of ``w`` [N, K] go through: W^T [K, N] in bf16."""
    return w.t().to(torch.bfloat16).contiguous()


def outlier_linears(calibration, percentile: float) -> list[str]:
    """Decoder linears whose calibrated input maximum exceeds ``OUTLIER_RATIO`` x its ``percentile``."""
    return sorted(n for n, s in calibration.layers.items() if s.absmax > OUTLIER_RATIO * s.percentiles[percentile])


def hot_inputs(calibration, percentile: float) -> dict[str, list[int]]:
    """The program's policy: per outlier linear, the ``HOT_INPUTS`` input channels with the largest
    calibrated maximum (ascending), which its ``decode`` method takes through float rows."""
    return {n: sorted(calibration.layers[n].channel_absmax.topk(HOT_INPUTS).indices.tolist())
            for n in outlier_linears(calibration, percentile)}
