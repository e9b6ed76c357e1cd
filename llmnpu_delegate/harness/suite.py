"""``llmnpu eval --tasks``: lm-eval tasks over the quantization modes, in the paper's Table 6 form
(one row per mode, one column per task metric, differences to fp32)."""
from __future__ import annotations

import contextlib
import logging
import os
import sys

from ..errors import LlmNpuError
from ..evaluate import MODES, PROGRAM_MODE, check_modes, mode_config, placed_rows, program_of, run_rows, shadow_overrides
from ..partitioner.placement import PAPER
from ..placed_numerics import check_kv_bits
from ..fanout import as_dicts
from ..models import LoadedModel, loaded
from . import require_lm_eval
from .offline_tasks import GROUP, task_dir

TABLE_MODES = ("fp32", "w8a8", "smoothquant", "w8a8-shadow", "w8a8-shadow-pruned")
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")


def run_tasks(lm: LoadedModel, tasks: list[str], modes: list[str], include_path: str | None = None,
              limit: float | None = None, overrides: dict | None = None, calib=None, text_file=None,
              progress: bool = True, program=None, ray: str | None = None, placements=(PAPER,),
              npu_kv_bits: int = 16) -> dict:
    """{mode: {task: {metric: (value, stderr)}}} and the sample counts, through ``lm_eval.simple_evaluate``;
    ``program``: the exported program the ``qnn`` mode scores; ``ray``: the modes as Ray tasks
    (``fanout.py``), a failed one as ``{"error": cause}``; ``placements``: a row per placement of each
    quantization mode (``evaluate.placed_rows``)."""
    check_modes(modes, program)
    check_kv_bits(npu_kv_bits)
    _task_manager(tasks, include_path, text_file)       # unknown tasks, a bad program: errors before any row runs
    if program is not None:
        program_of(lm, program)
    shown = progress and ray is None
    ran = run_rows(lm, calib, [(name, mode_config(mode, overrides), task_row,
                                (tasks, mode, include_path, limit, overrides, calib, text_file, shown,
                                 program if mode == PROGRAM_MODE else None, (placement, npu_kv_bits)))
                               for name, mode, placement in placed_rows(modes, placements)], progress, ray)
    results, samples = {}, {}
    for mode, row in as_dicts(ran.results).items():
        results[mode] = row.get("results", row)
        samples.update(row.get("samples", {}))
    return {"model": lm.spec, "limit": limit, "samples": samples, "results": results,
            **({"ray": ran.report(ray)} if ray else {})}


def task_row(lm, tasks: list[str], mode: str, include_path: str | None, limit: float | None,
             overrides: dict | None, calib, text_file, progress: bool, program, placed: tuple = (PAPER, 16)) -> dict:
    """One mode's row: {"results": {task: {metric: (value, stderr)}}, "samples": {task: count}};
    ``lm``: the model, or (spec, fingerprint) for a process that loads it (a Ray task); ``placed``:
    (placement, NPU K/V bits) of a quantization mode's attention."""
    from lm_eval import simple_evaluate

    from .lm import LlmNpuLM

    lm = loaded(lm)
    manager = _task_manager(tasks, include_path, text_file)
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    where = dict(zip(("placement", "npu_kv_bits"), placed)) if MODES.get(mode) is not None else {}
    model = LlmNpuLM(lm, quant=mode, calibration=calib, progress=progress, pte=program,
                     **shadow_overrides(MODES.get(mode), overrides), **where)
    # lm-eval prints progress notes: stdout is kept for results. Its bootstrap of a stderr forks a
    # process pool, which hangs in a Ray worker (a forked copy of its threads): its single-process
    # form draws the same seeded resamples, here and on Ray.
    with contextlib.redirect_stdout(sys.stderr), _env("DISABLE_MULTIPROC", "1"):
        out = simple_evaluate(model=model, tasks=tasks, limit=limit, task_manager=manager, log_samples=False,
                              bootstrap_iters=1000, verbosity="ERROR")
    results, samples = {}, {}
    for task, metrics in out["results"].items():
        if task in out.get("groups", {}) or task == GROUP:
            continue
        results[task] = {m.split(",")[0]: (v, metrics.get(m.replace(",", "_stderr,", 1)))
                         for m, v in metrics.items() if "," in m and "_stderr" not in m}
        samples[task] = out.get("n-samples", {}).get(task, {}).get("effective")
    return {"results": results, "samples": samples}


@contextlib.contextmanager
def _env(name: str, value: str):
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


def _task_manager(tasks: list[str], include_path: str | None, text_file):
    """lm-eval's task manager over the offline tasks (and ``include_path``); an unknown task is an error."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    paths = [str(task_dir(text_file))] + ([include_path] if include_path else [])
    manager = TaskManager(include_path=paths, verbosity="ERROR")
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise LlmNpuError(f"unknown task(s) {missing}: use {GROUP} ({', '.join(manager.match_tasks(['llmnpu_*']))}), "
                          "an lm-eval task name, or give --include-path DIR with your own task YAML")
    return manager


def _cell(value: float, stderr, base: float | None, lower_better: bool) -> str:
    err = f"±{stderr:.2f}" if isinstance(stderr, float) else ""
    if lower_better:
        rel = f" ({value / base:.3f}x)" if base else ""
        return f"{value:.3f}{err}{rel}"
    rel = f" ({100 * (value - base):+.1f})" if base is not None else ""
    return f"{100 * value:.1f}{'±' + format(100 * stderr, '.1f') if isinstance(stderr, float) else ''}{rel}"


def format_table(result: dict) -> str:
    """Rows: modes; columns: each task's metrics. Accuracies in points with their difference to fp32
    in points; perplexities with their ratio to fp32."""
    fp32 = result["results"].get("fp32", {})
    scored = [r for r in result["results"].values() if "error" not in r]
    columns = [(t, m) for t, ms in (scored[0] if scored else {}).items() for m in ms]
    lines = [f"model {result['model']}: lm-eval tasks ("
             + ", ".join(f"{t}: {n} samples" for t, n in result["samples"].items()) + ")"]
    head = ["mode"] + [f"{t.removeprefix('llmnpu_')} {m}" for t, m in columns]
    rows = [head]
    failed = []
    for mode, tasks in result["results"].items():
        if "error" in tasks:
            failed.append(f"{mode}: failed ({tasks['error']})")
            continue
        row = [mode]
        for t, m in columns:
            value, err = tasks[t][m]
            base = fp32.get(t, {}).get(m, (None,))[0] if mode != "fp32" else None
            row.append(_cell(value, err, base, any(k in m for k in LOWER_IS_BETTER)))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines + failed)
