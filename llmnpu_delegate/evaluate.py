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
from .fanout import Job, Ran, as_dicts, run_jobs
from .models import LoadedModel, decoder_layers, job_memory, loaded
from .partitioner.placement import PAPER
from .placed_numerics import apply_placement, check_kv_bits, row_name, swap_attention, swap_norms
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


def perplexity(model: nn.Module, windows: Tensor, desc: str = "eval", progress: bool = True) -> float:
    return window_scores(model, windows, desc, progress)["ppl"]


@torch.inference_mode()
def window_scores(model: nn.Module, windows: Tensor, desc: str = "eval", progress: bool = True,
                  reference: nn.Module | None = None) -> dict:
    """{"ppl"} of ``model`` over ``windows`` and, with a ``reference`` (the float model), the SQNR of
    its logits against the reference's: ExecuTorch's ``sqnr_eval`` (torchao's ``compute_error``,
    20 log10 |ref| / |ref - logits| over every position and vocabulary entry), over all windows."""
    nll, count, signal, noise = 0.0, 0, 0.0, 0.0
    for row in tqdm(windows, desc=desc, unit="window", disable=not progress, leave=False):
        logits = model(input_ids=row[None], use_cache=False).logits[0].float()
        nll += float(F.cross_entropy(logits[:-1], row[1:], reduction="sum"))
        count += row.numel() - 1
        if reference is not None:
            ref = reference(input_ids=row[None], use_cache=False).logits[0].double()
            signal += float(ref.square().sum())
            noise += float((ref - logits.double()).square().sum())
    out = {"ppl": math.exp(nll / count)}
    if reference is not None:
        out["logits_sqnr_db"] = 10 * math.log10(signal / noise) if noise > 0 else math.inf
    return out


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
    from .lower.program_numerics import apply_program_numerics, attention_encodings, norm_encodings, program_quant

    meta = program_of(lm, pte)
    model, _ = quantized_model(lm, program_quant(meta), calib, progress)
    changed = apply_program_numerics(model, meta, lm.model)
    return model, {**changed, "npu_norms": swap_norms(model, norm_encodings(meta)),
                   "npu_attention": swap_attention(model, attention_encodings(meta))}


def program_of(lm: LoadedModel, pte) -> dict:
    """The sidecar of ``pte``, a program the ``qnn`` mode can score for ``lm``; else a one-line error."""
    from .format.sidecar import load_sidecar
    from .lower.program_numerics import check_program

    meta = load_sidecar(pte)
    check_program(meta, pte)
    if meta["model"]["fingerprint"] != lm.fingerprint or meta["model"]["layers"] != len(decoder_layers(lm.model)):
        spec = meta["model"].get("spec", "another model")
        raise LlmNpuError(f"{pte} was exported from {spec} ({meta['model']['layers']} blocks), not from {lm.spec} "
                          f"({len(decoder_layers(lm.model))}): evaluate it with that model, or export the whole model")
    return meta


def run_quantized(lm: LoadedModel, windows: Tensor, calib, config: QuantConfig | None, desc: str,
                  progress: bool = True, program=None, placed: tuple = (PAPER, 16)) -> dict:
    """Quantize a copy of the model with ``config`` (or as the exported ``program`` computes) and
    measure its perplexity and outlier share; ``placed``: (placement, NPU K/V bits) of its attention
    (``placed_numerics.py``)."""
    if program is not None:
        model, changed = program_model(lm, program, calib, progress)
        return {**window_scores(model, windows, desc, progress, lm.model), "program": str(program), **changed}
    model, report = quantized_model(lm, config, calib, progress)
    where = apply_placement(lm, model, *placed, calib=calib)
    entry = {**window_scores(model, windows, desc, progress, lm.model), **where}
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
             overrides: dict | None = None, progress: bool = True, program=None, ray: str | None = None,
             placements=(PAPER,), npu_kv_bits: int = 16) -> dict:
    """Perplexity per mode. ``overrides`` replaces QuantConfig fields of the shadow modes; ``program``:
    the exported program the ``qnn`` mode reproduces; ``ray``: the modes as Ray tasks (``fanout.py``:
    ``"local"`` or a cluster's address), a failed one reported as ``{"error": cause}``; ``placements``:
    a row per placement for each quantization mode of ``MODES`` (``placed_rows``)."""
    check_modes(modes, program)
    check_kv_bits(npu_kv_bits)
    if program is not None:     # a bad program fails here, before any row runs
        program_of(lm, program)
    windows = eval_windows(eval_ids, window, max_tokens)
    need_calib = any(MODES.get(m) is not None for m in modes)
    calib = load_or_calibrate(lm.model, calib_ids, lm.fingerprint, calib_config, progress=progress) if need_calib else None
    samples = calibration_samples(calib_ids, calib_config) if any(m in RECIPES for m in modes) else None
    jobs = []
    for name, mode, placement in placed_rows(modes, placements):
        jobs.append((name, (mode_config(mode, overrides), name, program if mode == PROGRAM_MODE else None,
                            samples if mode in RECIPES else None, (placement, npu_kv_bits))))
    ran = _score_all(lm, windows, calib, jobs, progress, ray)
    return {"model": lm.spec, "tokens": int(windows.numel() - windows.shape[0]), "window": window,
            "results": as_dicts(ran.results), **({"ray": ran.report(ray)} if ray else {})}


def placed_rows(modes: list[str], placements=(PAPER,)) -> list[tuple[str, str, str]]:
    """[(row name, mode, placement)]: each quantization mode of ``MODES`` under each placement (its
    attention where the placement puts it: ``placed_numerics.py``); the float model, an exported
    program (its own placement) and ExecuTorch's recipes (their own graph) once, as they are."""
    rows = []
    for mode in modes:
        if MODES.get(mode) is None:
            rows.append((mode, mode, PAPER))
            continue
        rows += [(row_name(mode, p), mode, p) for p in placements]
    return rows


def mode_config(mode: str, overrides: dict | None = None) -> QuantConfig | None:
    """The QuantConfig a mode of ``MODES`` scores with (``overrides`` applied); None otherwise."""
    config = MODES.get(mode)
    knobs = shadow_overrides(config, overrides)
    return replace(config, **knobs) if knobs else config


def score(lm, windows: Tensor, calib, config: QuantConfig | None, desc: str, program=None,
          recipe_samples: Tensor | None = None, progress: bool = True, placed: tuple = (PAPER, 16)) -> dict:
    """One row of an evaluation: the perplexity (and what the mode reports) of the float model
    (``config`` None), a quantization mode (its attention as ``placed`` puts it), an exported
    ``program``'s numerics, or an ExecuTorch recipe (``desc`` names it; observed on
    ``recipe_samples``). ``lm``: the model, or (spec, fingerprint) for a process that loads it (a Ray
    task)."""
    lm = loaded(lm)
    if desc in RECIPES:
        scorer = recipe_model(lm, desc, recipe_samples, progress)
        return window_scores(scorer, windows, desc, progress, lm.model)
    if config is None and program is None:
        return {"ppl": perplexity(lm.model, windows, desc, progress)}
    return run_quantized(lm, windows, calib, config, desc, progress, program, placed)


def _score_all(lm: LoadedModel, windows: Tensor, calib, jobs: list[tuple[str, tuple]], progress: bool,
               ray: str | None) -> Ran:
    """{row name: score(...)} for ``jobs`` [(name, (config, desc, program, recipe samples, placed))]."""
    shown = progress and ray is None
    return run_rows(lm, calib, [(name, config, score, (windows, calib, config, desc, program, samples, shown, placed))
                                for name, (config, desc, program, samples, placed) in jobs], progress, ray)


def run_rows(lm: LoadedModel, calib, rows: list[tuple], progress: bool, ray: str | None) -> Ran:
    """The rows of an evaluation [(name, QuantConfig or None, fn, args)], each ``fn(lm, *args)``: here,
    or as Ray tasks that load the model themselves (``fn`` gets (spec, fingerprint) for ``lm``). On
    Ray the automatic pruning choices are made here first, on this machine's engine, and travel in
    the calibration: every task prunes as this process would."""
    if ray is None:
        return run_jobs([Job(name, fn, (lm, *args)) for name, _, fn, args in rows])
    if calib is not None:
        for _, config, _, _ in rows:
            choose_host_pruning(lm, calib, config, progress)
    threads, memory, ref = torch.get_num_threads(), eval_memory(lm.model), (lm.spec, lm.fingerprint)
    return run_jobs([Job(name, fn, (ref, *args), threads, memory) for name, _, fn, args in rows], ray)


def eval_memory(model: nn.Module) -> int:
    return job_memory(sum(p.numel() * 4 for p in model.parameters()))


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
          calib_config: CalibConfig = CalibConfig(), progress: bool = True, ray: str | None = None,
          placements=(PAPER,), npu_kv_bits: int = 16) -> list[dict]:
    """The trade-off curve (paper Fig. 16): clipping percentile (no pruning), then pruning rate, each
    point under each of ``placements`` (its attention as there: ``placed_numerics.py``); its rows as
    Ray tasks with ``ray`` (as ``evaluate``; a failed row holds ``error``)."""
    windows = eval_windows(eval_ids, window, max_tokens)
    calib = load_or_calibrate(lm.model, calib_ids, lm.fingerprint, calib_config, progress=progress)
    points = [(p, 0.0) for p in calib_config.percentiles]
    points += [(QuantConfig().clip_percentile, rate) for rate in SWEEP_PRUNING_RATES[1:]]
    rows, jobs = [], []
    for placement in placements:
        for p, rate in points:
            cfg = QuantConfig(outliers="shadow", clip_percentile=p, pruning_rate=rate)
            name = row_name(f"p{p}" if rate == 0.0 else f"prune {rate}", placement)
            rows.append({"clip_percentile": p, "pruning_rate": rate, "name": name})
            jobs.append((name, (cfg, name, None, None, (placement, npu_kv_bits))))
    results = as_dicts(_score_all(lm, windows, calib, jobs, progress, ray).results)
    return [{**row, **results[row.pop("name")]} for row in rows]
