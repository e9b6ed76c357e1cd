"""``pruning_rate="auto"``: the highest pruning rate whose accuracy cost stays inside a budget.

Pruning removes the shadow paths of the layers the importance profile ranks lowest
(``importance.layers_to_prune``). How many can go depends on the model, so the rate is measured, not
fixed: on the calibration text's held-apart windows (``Calibration.held_ids``: never seen by
calibration, and never the evaluation text), the quantized model's mean next-token loss at a
candidate rate may exceed its loss with every shadow path by at most ``log(1 + budget)`` nats (a
perplexity increase of ``budget``). Rates are tried on a grid by bisection, assuming the loss does not
fall as more paths go. The choice is cached in the calibration artefact, with its measured losses.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import LlmNpuError
from .calibrate import Calibration
from .config import QuantConfig
from .importance import importance_key, layers_to_prune

GRID = tuple(i / 20 for i in range(21))       # 0, 5 %, ..., 100 %


def auto_key(config: QuantConfig) -> str:
    ranking = importance_key(config) if config.importance == "output" else f"ratio/p{config.clip_percentile}"
    return f"auto/{ranking}/budget{config.pruning_budget}"


def chosen(calib: Calibration, config: QuantConfig) -> dict | None:
    """The cached choice for ``config`` ({"rate", "loss_all", "loss", "perplexity_ratio"}), if made."""
    return calib.importance.get(auto_key(config))


@torch.inference_mode()
def mean_loss(model: nn.Module, ids: Tensor) -> float:
    """Mean next-token cross entropy of ``model`` over the windows ``ids`` [n, L]."""
    logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
    return float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)))


def choose_rate(model: nn.Module, layers: dict, calib: Calibration, config: QuantConfig,
                importance: dict[str, float]) -> dict:
    """Pick the rate for ``model``, whose linears are the quantized ``layers`` (QuantLinear, shadow
    paths built), pruning in the order of ``importance``. Leaves every layer unpruned."""
    if calib.held_ids is None:
        raise LlmNpuError("pruning_rate='auto' needs held-apart calibration text, and this calibration has none "
                          "(its text is too short for the gaps between samples): give a longer calibration text "
                          "or a pruning rate in [0, 1]")
    losses: dict[float, float] = {}

    def loss(rate: float) -> float:
        if rate not in losses:
            pruned = layers_to_prune(importance, rate)
            for name, q in layers.items():
                q.pruned = name in pruned
            losses[rate] = mean_loss(model, calib.held_ids)
        return losses[rate]

    try:
        limit = loss(0.0) + math.log1p(config.pruning_budget)
        lo, hi = 0, len(GRID) - 1             # GRID[lo] is within budget; find the highest that is
        if loss(GRID[hi]) <= limit:
            lo = hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if loss(GRID[mid]) <= limit:
                lo = mid
            else:
                hi = mid
    finally:
        for q in layers.values():
            q.pruned = False
    rate = GRID[lo]
    return {"rate": rate, "loss_all": losses[0.0], "loss": losses[rate],
            "perplexity_ratio": math.exp(losses[rate] - losses[0.0]), "evaluations": float(len(losses))}


def resolve(config: QuantConfig, calib: Calibration) -> QuantConfig:
    """``config`` with an "auto" pruning rate replaced by the cached choice (``choose_rate`` first)."""
    if config.pruning_rate != "auto" or config.outliers != "shadow":
        return config
    choice = chosen(calib, config)
    if choice is None:
        raise LlmNpuError("internal: the automatic pruning rate was not chosen before use")
    return dataclasses.replace(config, pruning_rate=choice["rate"])
