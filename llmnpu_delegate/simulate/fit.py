"""The device profiles' fitted numbers, from the measurements in the repository.

Two fits, each by least squares on the relative error, deterministic:

- **The phone's NPU as QNN programs reach it** (``fit_phone``): the parameters of ``FITTED`` on
  SM8750, so that ``whole_npu.predict`` reproduces the training rows of ``data/aihub.csv``
  (``measured.py`` says which rows train; the others are never read here). Levenberg-Marquardt on
  the logarithms of the parameters.
- **The paper's implementation** (``fit_roofline``): Table 3's INT8 MatMul micro-benchmarks (SM8650),
  ``t = launch + max(flops / rate, weight_bytes / bandwidth)`` per processor, over a log grid
  refined around the best point. The NPU column gives the ``paper.*`` rates, the CPU column the
  CPU's float rate.

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


def fit_all() -> dict:
    """Both fits from the files in the repository: {"SM8750": {param: value}, "SM8650": {...}, errors}."""
    from .measured import measurements

    rows = [m for m in measurements() if m.training]
    phone = fit_phone(rows, load_device(FIT_SOC))
    table3 = load_device("SM8650")
    npu = fit_roofline(table3_rows(table3, "npu_int8_ms"))
    cpu = fit_roofline(table3_rows(table3, "cpu_int8_ms"))
    return {FIT_SOC: phone["params"], "unidentified": phone["unidentified"],
            "SM8650": {"paper.int8_ops_per_s": npu["ops_per_s"], "paper.weight_bytes_per_s": npu["bytes_per_s"],
                       "npu.graph_launch_s": npu["launch_s"], "cpu.float_ops_per_s": 0.5 * cpu["ops_per_s"]},
            "errors": {"aihub": dict(zip((m.label for m in rows), phone["row_errors"])),
                       "table3_npu": npu["row_errors"], "table3_cpu": cpu["row_errors"]}}


def _round(v: float) -> float:
    return round(v, 4 - int(math.floor(math.log10(abs(v)))))


def write(fits: dict) -> None:
    """Store the fitted values in the device files (each parameter keeps its source)."""
    if fits["unidentified"]:
        raise SystemExit(f"not written: the training rows do not decide {', '.join(fits['unidentified'])}")
    for soc in (FIT_SOC, "SM8650"):
        path = DEVICES_DIR / f"{soc}.json"
        doc = json.loads(path.read_text())
        for name, value in fits[soc].items():
            doc["params"][name]["value"] = _round(value)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n")
        tmp.replace(path)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    fits = fit_all()
    out = {k: (d if k == "unidentified" else {n: _round(v) for n, v in d.items()} if k != "errors" else
               {n: ({m: round(e, 3) for m, e in v.items()} if isinstance(v, dict) else [round(e, 3) for e in v])
                for n, v in d.items()}) for k, d in fits.items()}
    json.dump(out, sys.stdout, indent=1)
    print()
    if "--write" in argv:
        write(fits)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
