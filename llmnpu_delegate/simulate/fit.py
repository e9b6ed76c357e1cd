"""Fit a roofline to the paper's INT8 MatMul micro-benchmarks (Table 3), per processor.

``t = launch + max(flops / rate, weight_bytes / bandwidth)``: a fixed cost per call, then either the
arithmetic or the streaming of the INT8 weights bounds the time. Fitted by least squares on the
relative error (the rows span 0.9 to 19.6 ms), over a log grid refined around the best point;
deterministic and dependency-free. Run ``python -m llmnpu_delegate.simulate.fit`` to print the
values the device file stores.
"""
from __future__ import annotations

import itertools
import json
import math
import sys

from .device import load_device


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


def main() -> int:
    device = load_device("SM8650")
    out = {}
    for column in ("npu_int8_ms", "cpu_int8_ms"):
        fit = fit_roofline(table3_rows(device, column))
        out[column] = {k: (round(v, 6 - int(math.floor(math.log10(abs(v))))) if isinstance(v, float) else
                           [round(e, 3) for e in v]) for k, v in fit.items()}
    json.dump(out, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
