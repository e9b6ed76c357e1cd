"""What ``pruning_rate="auto"`` chooses, for this machine's engine and for a phone SoC, and what it buys.

    .venv/bin/python benchmarks/pruning_choice.py [--soc SM8650] [--against 0.75 0] [--runs 15]

Prints each target's choice (paths pruned, predicted prefill with every path, none and the chosen
ones, held-apart KL divergence), then times a 1,024-token prefill of the evaluation text with the
default against fixed pruning rates, interleaved in one process (medians; ratios to the default, so
the machine's noise hits every engine alike). Perplexity and agreement: ``llmnpu eval --modes fp32
w8a8-shadow w8a8-shadow-pruned`` and ``benchmarks/greedy_agreement.py``.
"""
import argparse
import json
import statistics
import subprocess
import time

from llmnpu_delegate import load_model
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import QuantConfig
from llmnpu_delegate.quantize.auto import chosen
from llmnpu_delegate.runtime.engine import Prefiller, choose_host_pruning
from llmnpu_delegate.simulate.phone import choose_pruning as choose_for_soc
from llmnpu_delegate.text import read_text, tokenize

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--soc", default="SM8650")
ap.add_argument("--against", type=float, nargs="*", default=[0.75, 0.0], help="fixed pruning rates to time")
ap.add_argument("--runs", type=int, default=15)
args = ap.parse_args()

cpu = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
print(next((line.split(":", 1)[1].strip() for line in cpu.splitlines() if line.startswith("Model name")), "?"))
lm = load_model(args.model)
t = time.perf_counter()
calib = default_calibration(lm, progress=False)
print(f"calibration {time.perf_counter() - t:.1f} s")
for config, choose in ((QuantConfig(), choose_host_pruning), (QuantConfig(pruning_target=args.soc), choose_for_soc)):
    t = time.perf_counter()
    choose(lm, calib, config, False)
    choice = chosen(calib, config)
    print(json.dumps({"target": config.pruning_target, "seconds": round(time.perf_counter() - t, 1),
                      "pruned": len(choice["pruned"]), "of": len(calib.layers),
                      **{k: round(v, 5) for k, v in choice.items() if isinstance(v, float)}}))

ids = tokenize(lm, read_text(None, "eval"))[:1024]
engines = {"default": Prefiller(lm, 256, quant=QuantConfig(), calibration=calib, progress=False)}
for rate in args.against:
    engines[f"pruning {rate:g}"] = Prefiller(lm, 256, quant=QuantConfig(pruning_rate=rate), calibration=calib,
                                             progress=False)
for engine in engines.values():
    engine(ids)
times = {k: [] for k in engines}
for _ in range(args.runs):
    for k, engine in engines.items():
        t = time.perf_counter()
        engine(ids)
        times[k].append(time.perf_counter() - t)
base = statistics.median(times["default"])
for k, ts in times.items():
    m = statistics.median(ts)
    print(f"{k:14s} {ids.numel() / m:7.1f} tok/s  time {m / base:.3f}x the default's  "
          f"shadow paths {sum(p.shadow for p in engines[k].plans.values())}")
