"""Ranking layers for shadow-path pruning.

"ratio" is the paper's measure: largest outlier / quantization scale, from calibration alone.
"output" measures what the ranking is for: the KL divergence between the float model's next-token
distribution and the quantized model's, when one layer's shadow path is removed while all others
keep theirs (minus the KL with all shadow paths on). On SmolLM2 the ratio ranking keeps the wrong
layers (perplexity +3.8 % at 85 % pruning), the measured one far fewer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .calibrate import Calibration
from .config import QuantConfig
from .linear import QuantLinear


def ratio_importance(calib: Calibration, percentile: float) -> dict[str, float]:
    out = {}
    for name, s in calib.layers.items():
        scale = max(s.percentiles[percentile], 1e-12) / 127
        out[name] = s.absmax / scale
    return out


def importance_key(config: QuantConfig) -> str:
    return f"output/p{config.clip_percentile}/{config.weights}"


@torch.inference_mode()
def logits_of(model: nn.Module, ids: Tensor) -> Tensor:
    """Next-token logits [n * L, V] of the sequences ``ids`` [n, L]."""
    logits = model(input_ids=ids.reshape(-1, ids.shape[-1]), use_cache=False).logits
    return logits.reshape(-1, logits.shape[-1]).float()


def _kl(ref_logp: Tensor, logits: Tensor) -> float:
    return float(F.kl_div(logits.log_softmax(-1), ref_logp, log_target=True, reduction="batchmean"))


@torch.inference_mode()
def output_importance(model: nn.Module, layers: dict[str, QuantLinear], probe_ids: Tensor,
                      float_logits: Tensor, progress: bool = True) -> dict[str, float]:
    """Per-layer increase of KL(float || quantized) when that layer alone loses its shadow path."""
    ref = float_logits.log_softmax(-1)
    for m in layers.values():
        m.pruned = False
    base = _kl(ref, logits_of(model, probe_ids))
    out = {}
    for name, m in tqdm(layers.items(), desc="profiling outlier importance", unit="layer", disable=not progress):
        m.pruned = True
        out[name] = _kl(ref, logits_of(model, probe_ids)) - base
        m.pruned = False
    return out


def layers_to_prune(importance: dict[str, float], rate: float) -> set[str]:
    """The ``rate`` share of layers with the lowest importance."""
    ranked = sorted(importance, key=lambda n: (importance[n], n))
    return set(ranked[: round(rate * len(ranked))])
