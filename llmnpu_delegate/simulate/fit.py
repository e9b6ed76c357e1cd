"""The device profiles' fitted numbers, from the measurements in the repository.

Three fits, deterministic:

- **What one graph execute costs before its work** (``fit_launch``): per SoC, the fastest whole-model
  QNN execute in ``data/aihub_graph_execute.csv`` (a small model with every layer on the NPU): an
  upper bound on ``npu.graph_launch_s``, since that row's own work is in it too.

- **The phone's NPU as QNN programs reach it** (``fit_phone``, least squares on the relative
  error): the parameters of ``FITTED`` on SM8750, with the launch above, so that ``whole_npu.predict`` reproduces the training rows of ``data/aihub.csv``
  (``measured.py`` says which rows train; the others are never read here). Levenberg-Marquardt on
  the logarithms of the parameters.
- **The paper's implementation** (``fit_roofline``): Table 3's INT8 MatMul micro-benchmarks (SM8650),
  ``t = launch + max(flops / rate, weight_bytes / bandwidth)`` per processor, over a log grid
  refined around the best point. The NPU column gives the ``paper.*`` rates and launch (its
  runtime's, ten times a QNN graph execute's), the CPU column the CPU's float rate.

``python -m llmnpu_delegate.simulate.fit`` prints both; ``--write`` stores them in the device files
(what ``tests/test_simulate.py`` checks they hold).
"""
from __future__ import annotations

import itertools
import json
import math
import sys

import numpy as np

from .device import DEVICES_DIR, Device, load_device


def roofline(flops: float, weight_bytes: float, launch: float, rate: float, bandwidth: float) -> float:
    return launch + max(flops / rate, weight_bytes / bandwidth)


def _loss(rows, launch, rate, bandwidth) -> float:
    return sum((roofline(f, b, launch, rate, bandwidth) / t - 1) ** 2 for f, b, t in rows)


def fit_roofline(rows: list[tuple[float, float, float]]) -> dict:
    """``rows``: (flops, weight bytes, seconds). Returns launch_s, ops_per_s, bytes_per_s and the
    relative error of each row."""
    best = None
    grid = (1e-5, 1e-4, 1e-3), (1e10, 1e11, 1e12, 1e13, 1e14), (1e9, 1e10, 1e11, 1e12)
    spans = [3.0, 10.0, 10.0]
    for _ in range(40):   # refine a 9x9x9 grid around the best point, shrinking the span
        cands = [[c * spans[i] ** (k / 4) for k in range(-4, 5)] for i, c in enumerate(
            best[1:] if best else (3e-4, 1e12, 1e10))] if best else [
            [a * 10 ** (k / 4) for a in g for k in range(4)] for g in grid]
        for launch, rate, bw in itertools.product(*cands):
            loss = _loss(rows, launch, rate, bw)
            if best is None or loss < best[0]:
                best = (loss, launch, rate, bw)
        spans = [max(s ** 0.7, 1.0005) for s in spans]
    _, launch, rate, bw = best
    errors = [roofline(f, b, launch, rate, bw) / t - 1 for f, b, t in rows]
    return {"launch_s": launch, "ops_per_s": rate, "bytes_per_s": bw, "row_errors": errors}


def table3_rows(device, column: str) -> list[tuple[float, float, float]]:
    """(flops, INT8 weight bytes, seconds) of Table 3's rows for one column."""
    bench = device.microbenchmarks
    col = bench["columns"].index(column)
    return [(2.0 * row[0] * row[1] * row[2], float(row[1] * row[2]), row[col] / 1e3) for row in bench["rows"]]


FIT_SOC = "SM8750"
# what the AI Hub rows decide, with a starting point of the right order of magnitude
# a parameter that reaches 10^4 times its start either way is one the rows cannot decide
SPAN = math.log(1e4)
FITTED = {"npu.a16_ops_per_s": 1e13, "npu.fp16_ops_per_s": 3e12, "npu.vector_elems_per_s": 1e10,
          "cpu.kv_update_bytes_per_s": 1e10}


def levenberg_marquardt(residuals, x0: np.ndarray, span: float, iterations: int = 200) -> np.ndarray:
    """Minimise ``|residuals(x)|^2`` from ``x0`` within ``x0 +- span`` (numerical Jacobian,
    multiplicative damping)."""
    lo, hi = np.asarray(x0, dtype=float) - span, np.asarray(x0, dtype=float) + span
    x, lam = np.asarray(x0, dtype=float), 1e-2
    r = residuals(x)
    cost = float(r @ r)
    for _ in range(iterations):
        jac = np.empty((len(r), len(x)))
        for j in range(len(x)):
            dx = np.zeros_like(x)
            dx[j] = 1e-6
            jac[:, j] = (residuals(x + dx) - r) / 1e-6
        a, g = jac.T @ jac, jac.T @ r
        while lam < 1e12:
            step = np.clip(x + np.linalg.solve(a + lam * np.diag(np.diag(a) + 1e-9), -g), lo, hi) - x
            r2 = residuals(x + step)
            if float(r2 @ r2) < cost:
                break
            lam *= 10
        else:
            return x
        improvement = cost - float(r2 @ r2)
        x, r, cost, lam = x + step, r2, float(r2 @ r2), max(lam / 10, 1e-9)
        if improvement < 1e-12:
            break
    return x


def fit_phone(rows, device: Device) -> dict:
    """The values of ``FITTED`` that make ``device`` predict ``rows`` (``measured.Measurement``s) best,
    and each row's relative error."""
    from .measured import predict_row

    names = list(FITTED)

    def candidate(logs):
        return device.with_params({n: float(math.exp(v)) for n, v in zip(names, logs)})

    def residuals(logs):
        dev = candidate(logs)
        return np.array([predict_row(m, dev)["tok_s"] / m.prefill_tok_s - 1 for m in rows])

    start = np.log([FITTED[n] for n in names])
    best = levenberg_marquardt(residuals, start, SPAN)
    return {"params": {n: float(math.exp(v)) for n, v in zip(names, best)},
            "row_errors": [float(e) for e in residuals(best)],
            "unidentified": [n for n, v, s in zip(names, best, start) if abs(v - s) > SPAN - 1e-6]}


def fit_launch(rows) -> dict[str, tuple[float, str]]:
    """Per SoC: (seconds, source) of its fastest single-graph execute (``measured.GraphExecute``s)."""
    out = {}
    for soc in sorted({r.soc for r in rows}):
        best = min((r for r in rows if r.soc == soc), key=lambda r: r.seconds)
        out[soc] = (best.seconds, f"fit: the fastest whole-model QNN execute in AI Hub's tables for {soc}, "
                                  f"{best.label}, {best.seconds * 1e3:.3g} ms for {best.layers} NPU layers "
                                  "(data/aihub_graph_execute.csv; llmnpu_delegate/simulate/fit.py): an upper "
                                  "bound on what a graph execute costs before its work")
    return out


def fit_all() -> dict:
    """Every fit from the files in the repository: {soc: {param: value}}, the sources of the values
    written whole ({soc: {param: source}}), the phone fit's unidentified parameters and each fit's errors."""
    from .measured import graph_executes, measurements

    launch = fit_launch(graph_executes())
    rows = [m for m in measurements() if m.training]
    phone = fit_phone(rows, load_device(FIT_SOC).with_params({"npu.graph_launch_s": launch[FIT_SOC][0]}))
    table3 = load_device("SM8650")
    npu = fit_roofline(table3_rows(table3, "npu_int8_ms"))
    cpu = fit_roofline(table3_rows(table3, "cpu_int8_ms"))
    fits = {soc: {"npu.graph_launch_s": seconds} for soc, (seconds, _) in launch.items()}
    fits[FIT_SOC].update(phone["params"])
    fits.setdefault("SM8650", {}).update({
        "paper.int8_ops_per_s": npu["ops_per_s"], "paper.weight_bytes_per_s": npu["bytes_per_s"],
        "paper.graph_launch_s": npu["launch_s"], "cpu.float_ops_per_s": 0.5 * cpu["ops_per_s"]})
    return {"params": fits, "sources": {soc: {"npu.graph_launch_s": source} for soc, (_, source) in launch.items()},
            "unidentified": phone["unidentified"],
            "errors": {"aihub": dict(zip((m.label for m in rows), phone["row_errors"])),
                       "table3_npu": npu["row_errors"], "table3_cpu": cpu["row_errors"]}}


def _round(v: float) -> float:
    return round(v, 4 - int(math.floor(math.log10(abs(v)))))


def write(fits: dict) -> None:
    """Store the fitted values in the device files (each parameter keeps its source)."""
    if fits["unidentified"]:
        raise SystemExit(f"not written: the training rows do not decide {', '.join(fits['unidentified'])}")
    for soc, params in fits["params"].items():
        path = DEVICES_DIR / f"{soc}.json"
        doc = json.loads(path.read_text())
        for name, value in params.items():
            source = fits["sources"].get(soc, {}).get(name)
            doc["params"][name] = ({"value": _round(value), "source": source} if source
                                   else {**doc["params"][name], "value": _round(value)})
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fits = fit_all()
    errors = {n: ({m: round(e, 3) for m, e in v.items()} if isinstance(v, dict) else [round(e, 3) for e in v])
              for n, v in fits["errors"].items()}
    out = {**{soc: {n: _round(v) for n, v in p.items()} for soc, p in fits["params"].items()},
           "unidentified": fits["unidentified"], "errors": errors}
    json.dump(out, sys.stdout, indent=1)
    print()
    if "--write" in argv:
        write(fits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
