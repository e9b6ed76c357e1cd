"""``quantize_``: replace the decoder blocks' linears with QuantLinear, in place (one verb)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import LlmNpuError
from ..kernels import QMAX
from . import auto
from .calibrate import Calibration, quantizable_linears
from .config import QuantConfig
from .importance import (
    importance_key,
    layers_to_prune,
    logits_of,
    output_importance,
    ratio_importance,
)
from .linear import QuantLinear, quantize_weight
from .shadow_rows import PEAK_CHANNELS, dense_channels, hot_channels, peak_channels, shadow_rows


@dataclass
class QuantReport:
    config: QuantConfig
    layers: int
    shadow_layers: list[str] = field(default_factory=list)
    pruned_layers: list[str] = field(default_factory=list)
    hot_rows_bytes: int = 0          # float weight rows held in RAM for the shadow path
    float_rows_bytes: int = 0        # what keeping every float row in RAM would cost


def _smooth_factors(x_absmax: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    # SmoothQuant: s_j = max|X_j|^a / max|W_j|^(1-a); x / s and W * s leave x @ W^T unchanged.
    w_absmax = w.detach().abs().amax(dim=0).clamp_min(1e-5)
    return (x_absmax.clamp_min(1e-5).pow(alpha) / w_absmax.pow(1 - alpha)).clamp_min(1e-5)


def _build(lin: nn.Linear, name: str, calib: Calibration, config: QuantConfig, fingerprint: str) -> QuantLinear:
    stats = calib.layers[name]
    w, smooth, shadow, clip = lin.weight, None, None, None
    full = stats.absmax / QMAX
    if config.outliers == "smooth":
        smooth = _smooth_factors(stats.channel_absmax, w, config.smooth_alpha)
        w = w.detach() * smooth[None, :]
        full = float((stats.channel_absmax / smooth).max()) / QMAX
    w_q, w_scale = quantize_weight(w, config.weights)
    act = full
    if config.outliers == "shadow":
        clip = calib.threshold(name, config.clip_percentile)
        act = clip / QMAX
        hot = hot_channels(stats.channel_outliers[config.clip_percentile], config.hot_coverage)
        shadow = shadow_rows(fingerprint, name, lin.weight, hot)
    return QuantLinear(w_q, w_scale, lin.bias, act, max(full, 1e-12), clip, shadow, smooth)


@dataclass(frozen=True)
class LinearPlan:
    """What an NPU backend needs to run one linear: its static per-tensor activation scale and, when
    it keeps a shadow path, the clipping threshold, the hot channels whose float rows stay in RAM
    (the engine's), the dense ones a static program multiplies as a whole (``dense_channels``) and
    the peak ones an NPU graph multiplies itself under placement piece ``peak`` (``peak_channels``)."""
    act_scale: float
    clip: float | None = None
    hot: torch.Tensor | None = None
    dense: torch.Tensor | None = None
    peak: torch.Tensor | None = None

    @property
    def shadow(self) -> bool:
        return self.clip is not None


def plan_linears(model: nn.Module, calib: Calibration, config: QuantConfig, fingerprint: str,
                 progress: bool = True, cost: auto.ShadowCost | None = None) -> dict[str, LinearPlan]:
    """Per-linear quantization decisions of ``quantize_`` without touching ``model`` (weights are
    converted later, by the backend that compiles them).

    Pruning by output effect needs a one-time profile, and an "auto" rate a choice made with
    ``cost``; both are made (on a temporarily quantized model, then restored) and cached in
    ``calib`` like ``quantize_`` does.
    """
    if config.outliers == "smooth":
        raise LlmNpuError("the chunked NPU engine runs outliers='shadow' or 'none'; SmoothQuant rescales "
                          "activations per channel, which a per-tensor NPU graph cannot do: use "
                          "`llmnpu eval` to measure it")
    calib.check_model(fingerprint)
    linears = quantizable_linears(model)
    calib.check_linears(linears)
    fixed_needs_profile = (config.prunes and not auto.is_auto(config) and config.importance == "output"
                           and importance_key(config) not in calib.importance)
    if fixed_needs_profile or auto.needs_choice(calib, config):
        try:
            quantize_(model, calib, config, fingerprint, progress, cost)
        finally:
            for name, lin in linears.items():
                _set_submodule(model, name, lin)
    pruned = pruned_set(calib, config)
    plans = {}
    for name in linears:
        stats = calib.layers[name]
        full = max(stats.absmax / QMAX, 1e-12)
        if config.outliers == "shadow" and name not in pruned:
            clip = calib.threshold(name, config.clip_percentile)
            counts = stats.channel_outliers[config.clip_percentile]
            plans[name] = LinearPlan(clip / QMAX, clip, hot_channels(counts, config.hot_coverage),
                                     dense_channels(counts, stats.elements),
                                     peak_channels(stats.channel_absmax, clip, linears[name].weight, PEAK_CHANNELS))
        else:
            plans[name] = LinearPlan(full)
    return plans


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent), leaf, module)


def pruned_set(calib: Calibration, config: QuantConfig) -> set[str]:
    """The layers ``config`` prunes: an "auto" config's cached choice, else the ``pruning_rate`` share
    that ranks lowest (the importance profile must be in ``calib``)."""
    if not config.prunes:
        return set()
    if auto.is_auto(config):
        return auto.pruned_layers(calib, config)
    importance = (ratio_importance(calib, config.clip_percentile) if config.importance == "ratio"
                  else calib.importance[importance_key(config)])
    return layers_to_prune(importance, config.pruning_rate)


@torch.inference_mode()
def quantize_(model: nn.Module, calib: Calibration, config: QuantConfig, fingerprint: str,
              progress: bool = True, cost: auto.ShadowCost | None = None) -> QuantReport:
    """Quantize ``model`` (a float causal LM) in place with ``config`` and calibration ``calib``.

    With pruning by measured output effect, the per-layer effect is profiled on calibration's probe
    tokens the first time it is needed and stored in ``calib`` (and re-saved if it has a path). An
    "auto" pruning rate not chosen yet is chosen with ``cost`` (``quantize/auto.py``), and stored alike.
    """
    calib.check_model(fingerprint)
    linears = quantizable_linears(model)
    calib.check_linears(linears)
    key = importance_key(config)
    choosing = auto.needs_choice(calib, config)
    if choosing and cost is None:
        auto.pruned_layers(calib, config)       # says how to get the choice
    must_prune = choosing and auto.must_prune(cost, config)     # else no profile is needed for the choice
    wants_importance = config.prunes and (must_prune if choosing else not auto.is_auto(config))
    need_profile = wants_importance and config.importance == "output" and key not in calib.importance
    float_logits = logits_of(model, calib.probe_ids) if need_profile else None
    held_reference = auto.log_probs(model, calib.held_ids) if must_prune and calib.held_ids is not None else None

    layers = {name: _build(lin, name, calib, config, fingerprint) for name, lin in linears.items()}
    for name, q in layers.items():
        _set_submodule(model, name, q)

    report = QuantReport(config, len(layers))
    if config.outliers != "shadow":
        return report

    def importance() -> dict[str, float]:
        if config.importance == "ratio":
            return ratio_importance(calib, config.clip_percentile)
        if key not in calib.importance:
            calib.importance[key] = output_importance(model, layers, calib.probe_ids, float_logits, calib,
                                                      config.clip_percentile, progress)
            if calib.path is not None:
                calib.save()
        return calib.importance[key]

    if choosing:
        calib.pruning[auto.auto_key(config)] = auto.choose(model, layers, calib, config, importance,
                                                           lambda: held_reference, cost)
        if calib.path is not None:
            calib.save()
    elif config.prunes and not auto.is_auto(config):
        importance()
    pruned = pruned_set(calib, config)
    report.config = auto.resolve(config, calib)
    for name, q in layers.items():
        q.pruned = name in pruned
        if q.pruned:
            q.shadow = None  # frees its hot rows: a pruned layer has no float path at all
            report.pruned_layers.append(name)
        else:
            report.shadow_layers.append(name)
            report.hot_rows_bytes += q.shadow.resident_bytes
            report.float_rows_bytes += q.in_features * q.out_features * 4
            q.shadow.reset_counts()
        q.outlier_elements = q.seen_elements = q.saturated_elements = 0  # profiling runs do not count
    return report


def outlier_counters(model: nn.Module) -> dict[str, int]:
    """Totals over all QuantLinear modules since they were built."""
    qs = [m for m in model.modules() if isinstance(m, QuantLinear)]
    return {"outlier_elements": sum(m.outlier_elements for m in qs),
            "seen_elements": sum(m.seen_elements for m in qs),
            "saturated_elements": sum(m.saturated_elements for m in qs),
            "cold_fetches": sum(m.shadow.cold_fetches for m in qs if m.shadow is not None),
            "hot_hits": sum(m.shadow.hot_hits for m in qs if m.shadow is not None)}
