"""Accuracy harness: perplexity of the float model and of each quantization mode on held-out text."""
from __future__ import annotations

import copy
import math
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from tqdm.auto import tqdm

from .errors import LlmNpuError
from .models import LoadedModel, decoder_layers
from .quantize.calibrate import calibration_samples
from .recipes import RECIPES, recipe_model
from .quantize import CalibConfig, QuantConfig, load_or_calibrate, outlier_counters, quantize_
from .runtime.engine import choose_host_pruning
from .text import calibration_ids

# Mode name -> config (None: the float model). The first three are the baselines.
MODES: dict[str, QuantConfig | None] = {
    "fp32": None,
    "w8a8": QuantConfig(outliers="none"),
    "smoothquant": QuantConfig(outliers="smooth", smooth_alpha=0.5),
    "w8a8-shadow": QuantConfig(outliers="shadow", pruning_rate=0.0),
    "w8a8-shadow-pruned": QuantConfig(outliers="shadow"),
    "w8a8-shadow-tensorw": QuantConfig(outliers="shadow", pruning_rate=0.0, weights="tensor"),
}
DEFAULT_MODE = "w8a8-shadow-pruned"     # the product's default: shadow outliers, automatic pruning
# An exported program's numerics (lower/program_numerics.py): needs the program (--pte PATH)
PROGRAM_MODE = "qnn"
# ExecuTorch's own Qualcomm quantization of the model (recipes.py), scored as a peer
ALL_MODES = (*MODES, PROGRAM_MODE, *RECIPES)


def shadow_overrides(config: QuantConfig | None, overrides: dict | None) -> dict:
    """The ``overrides`` (QuantConfig fields) that apply to a mode: the shadow knobs of shadow modes,
    the pruning rate only to modes that prune."""
    if config is None or config.outliers != "shadow":
        return {}
    return {k: v for k, v in (overrides or {}).items() if k != "pruning_rate" or config.prunes}


def eval_windows(ids: Tensor, window: int, max_tokens: int) -> Tensor:
    """[n, window] non-overlapping windows; each predicts window-1 tokens; n*(window-1) >= max_tokens when possible."""
    if window < 2:
        raise LlmNpuError(f"window must be at least 2 tokens, got {window}")
    if max_tokens < 1:
        raise LlmNpuError(f"max tokens must be positive, got {max_tokens}")
    available = ids.numel() // window
    if available == 0:
        raise LlmNpuError(f"evaluation text has {ids.numel()} tokens, fewer than one window of {window}: "
                          f"give a longer text or a smaller --window")
    n = min(available, math.ceil(max_tokens / (window - 1)))
    return ids[: n * window].reshape(n, window)


@torch.inference_mode()
def perplexity(model: nn.Module, windows: Tensor, desc: str = "eval", progress: bool = True) -> float:
    nll, count = 0.0, 0
    for row in tqdm(windows, desc=desc, unit="window", disable=not progress, leave=False):
        logits = model(input_ids=row[None], use_cache=False).logits[0, :-1].float()
        nll += float(F.cross_entropy(logits, row[1:], reduction="sum"))
        count += row.numel() - 1
    return math.exp(nll / count)


def quantized_model(lm: LoadedModel, config: QuantConfig, calib=None, progress: bool = True):
    """(a copy of the model quantized with ``config``, its QuantReport); ``calib`` defaults to the
    cached calibration on the shipped calibration text. An automatic pruning is the engine's choice
    on this machine (``runtime.engine.choose_host_pruning``)."""
    if calib is None:
        calib = load_or_calibrate(lm.model, calibration_ids(lm), lm.fingerprint, CalibConfig(), progress=progress)
    choose_host_pruning(lm, calib, config, progress)
    model = copy.deepcopy(lm.model)
    return model, quantize_(model, calib, config, lm.fingerprint, progress)


def program_model(lm: LoadedModel, pte, calib=None, progress: bool = True):
    """(a quantized copy of the model computing what the exported program ``pte`` computes, what that
    changed): the ``qnn`` mode (``lower/program_numerics.py``)."""
    from .format.sidecar import load_sidecar
    from .lower.program_numerics import apply_program_numerics, check_program, program_quant

    meta = load_sidecar(pte)
    check_program(meta, pte)
    if meta["model"]["fingerprint"] != lm.fingerprint or meta["model"]["layers"] != len(decoder_layers(lm.model)):
        spec = meta["model"].get("spec", "another model")
        raise LlmNpuError(f"{pte} was exported from {spec} ({meta['model']['layers']} blocks), not from {lm.spec} "
                          f"({len(decoder_layers(lm.model))}): evaluate it with that model, or export the whole model")
    model, _ = quantized_model(lm, program_quant(meta), calib, progress)
    return model, apply_program_numerics(model, meta)


def run_quantized(lm: LoadedModel, windows: Tensor, calib, config: QuantConfig | None, desc: str,
                  progress: bool = True, program=None) -> dict:
    """Quantize a copy of the model with ``config`` (or as the exported ``program`` computes) and
    measure its perplexity and outlier share."""
    if program is not None:
        model, changed = program_model(lm, program, calib, progress)
        return {"ppl": perplexity(model, windows, desc, progress), "program": str(program), **changed}
    model, report = quantized_model(lm, config, calib, progress)
    entry = {"ppl": perplexity(model, windows, desc, progress)}
    c = outlier_counters(model)
    # share of elements beyond a full-range (calibrated absmax) scale, clipped by saturation
    entry["saturated_fraction"] = c["saturated_elements"] / max(c["seen_elements"], 1)
    if config.outliers == "shadow":
        entry["outlier_fraction"] = c["outlier_elements"] / max(c["seen_elements"], 1)
        entry["clip_percentile"] = config.clip_percentile
        entry["shadow_layers"] = len(report.shadow_layers)
        entry["cold_fetches"] = c["cold_fetches"]
        entry["hot_rows_mib"] = round(report.hot_rows_bytes / 2**20, 2)
        entry["all_rows_mib"] = round(report.float_rows_bytes / 2**20, 2)
        if config.prunes:
            entry["pruning_rate"] = report.config.pruning_rate      # "auto" resolved to the rate it chose
            entry["importance"] = config.importance
    return entry


def evaluate(lm: LoadedModel, eval_ids: Tensor, calib_ids: Tensor, modes: list[str], window: int = 512,
             max_tokens: int = 4096, calib_config: CalibConfig = CalibConfig(),
             overrides: dict | None = None, progress: bool = True, program=None) -> dict:
    """Perplexity per mode. ``overrides`` replaces QuantConfig fields of the shadow modes; ``program``:
    the exported program the ``qnn`` mode reproduces."""
    check_modes(modes, program)
    windows = eval_windows(eval_ids, window, max_tokens)
    need_calib = any(MODES.get(m) is not None for m in modes)
    calib = load_or_calibrate(lm.model, calib_ids, lm.fingerprint, calib_config, progress=progress) if need_calib else None
    results = {}
    for mode in modes:
        if mode == PROGRAM_MODE:
            results[mode] = run_quantized(lm, windows, calib, None, mode, progress, program)
            continue
        if mode in RECIPES:      # observed on the samples our calibration takes from the same text
            scorer = recipe_model(lm, mode, calibration_samples(calib_ids, calib_config), progress)
            results[mode] = {"ppl": perplexity(scorer, windows, mode, progress)}
            continue
        config = MODES[mode]
        if config is None:
            results[mode] = {"ppl": perplexity(lm.model, windows, mode, progress)}
            continue
        knobs = shadow_overrides(config, overrides)
        if knobs:
            config = replace(config, **knobs)
        results[mode] = run_quantized(lm, windows, calib, config, mode, progress)
    return {"model": lm.spec, "tokens": int(windows.numel() - windows.shape[0]), "window": window,
            "results": results}


def check_modes(modes: list[str], program) -> None:
    """Known modes, and the program the ``qnn`` mode needs (and nothing else takes)."""
    unknown = [m for m in modes if m not in ALL_MODES]
    if unknown:
        raise LlmNpuError(f"unknown mode(s) {unknown}: choose from {', '.join(ALL_MODES)}")
    if (PROGRAM_MODE in modes) != (program is not None):
        raise LlmNpuError(f"the {PROGRAM_MODE} mode evaluates an exported program and only it takes one: give "
                          f"both --modes ... {PROGRAM_MODE} and --pte PATH (a .pte from llmnpu export)")


SWEEP_PRUNING_RATES = (0.0, 0.5, 0.7, 0.85, 0.95, 1.0)


def sweep(lm: LoadedModel, eval_ids: Tensor, calib_ids: Tensor, window: int = 512, max_tokens: int = 4096,
          calib_config: CalibConfig = CalibConfig(), progress: bool = True) -> list[dict]:
    """The trade-off curve (paper Fig. 16): clipping percentile (no pruning), then pruning rate."""
    windows = eval_windows(eval_ids, window, max_tokens)
    calib = load_or_calibrate(lm.model, calib_ids, lm.fingerprint, calib_config, progress=progress)
    rows = []
    for p in calib_config.percentiles:
        cfg = QuantConfig(outliers="shadow", clip_percentile=p, pruning_rate=0.0)
        rows.append({"clip_percentile": p, "pruning_rate": 0.0, **run_quantized(lm, windows, calib, cfg, f"p{p}", progress)})
    for rate in SWEEP_PRUNING_RATES[1:]:
        cfg = QuantConfig(outliers="shadow", pruning_rate=rate)
        rows.append({"clip_percentile": cfg.clip_percentile, "pruning_rate": rate,
                     **run_quantized(lm, windows, calib, cfg, f"prune {rate}", progress)})
    return rows
