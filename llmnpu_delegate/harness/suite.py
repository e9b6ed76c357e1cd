"""``llmnpu eval --tasks``: lm-eval tasks over the quantization modes, in the paper's Table 6 form
(one row per mode, one column per task metric, differences to fp32)."""
from __future__ import annotations

import contextlib
import logging
import sys

from ..errors import LlmNpuError
from ..evaluate import MODES, PROGRAM_MODE, check_modes, shadow_overrides
from ..models import LoadedModel
from . import require_lm_eval
from .offline_tasks import GROUP, task_dir

TABLE_MODES = ("fp32", "w8a8", "smoothquant", "w8a8-shadow", "w8a8-shadow-pruned")
LOWER_IS_BETTER = ("perplexity", "bits_per_byte")


def run_tasks(lm: LoadedModel, tasks: list[str], modes: list[str], include_path: str | None = None,
              limit: float | None = None, overrides: dict | None = None, calib=None, text_file=None,
              progress: bool = True, program=None) -> dict:
    """{mode: {task: {metric: (value, stderr)}}} and the sample counts, through ``lm_eval.simple_evaluate``;
    ``program``: the exported program the ``qnn`` mode scores."""
    require_lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from .lm import LlmNpuLM

    check_modes(modes, program)
    paths = [str(task_dir(text_file))] + ([include_path] if include_path else [])
    manager = TaskManager(include_path=paths, verbosity="ERROR")
    missing = [t for t in tasks if not manager.match_tasks([t])]
    if missing:
        raise LlmNpuError(f"unknown task(s) {missing}: use {GROUP} ({', '.join(manager.match_tasks(['llmnpu_*']))}), "
                          "an lm-eval task name, or give --include-path DIR with your own task YAML")
    logging.getLogger("lm_eval").setLevel(logging.WARNING)
    results, samples = {}, {}
    for mode in modes:
        model = LlmNpuLM(lm, quant=mode, calibration=calib, progress=progress,
                         pte=program if mode == PROGRAM_MODE else None,
                         **shadow_overrides(MODES.get(mode), overrides))
        with contextlib.redirect_stdout(sys.stderr):    # lm-eval prints progress notes: keep stdout for results
            out = simple_evaluate(model=model, tasks=tasks, limit=limit, task_manager=manager, log_samples=False,
                                  bootstrap_iters=1000, verbosity="ERROR")
        results[mode] = {}
        for task, metrics in out["results"].items():
            if task in out.get("groups", {}) or task == GROUP:
                continue
            results[mode][task] = {m.split(",")[0]: (v, metrics.get(m.replace(",", "_stderr,", 1)))
                                   for m, v in metrics.items() if "," in m and "_stderr" not in m}
            samples[task] = out.get("n-samples", {}).get(task, {}).get("effective")
    return {"model": lm.spec, "limit": limit, "samples": samples, "results": results}


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
    columns = [(t, m) for t, ms in next(iter(result["results"].values())).items() for m in ms]
    lines = [f"model {result['model']}: lm-eval tasks ("
             + ", ".join(f"{t}: {n} samples" for t, n in result["samples"].items()) + ")"]
    head = ["mode"] + [f"{t.removeprefix('llmnpu_')} {m}" for t, m in columns]
    rows = [head]
    for mode, tasks in result["results"].items():
        row = [mode]
        for t, m in columns:
            value, err = tasks[t][m]
            base = fp32.get(t, {}).get(m, (None,))[0] if mode != "fp32" else None
            row.append(_cell(value, err, base, any(k in m for k in LOWER_IS_BETTER)))
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)
