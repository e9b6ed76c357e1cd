"""Every exact INT8 GEMM path this CPU can run against fp32 ``F.linear``, one thread (a benchmark,
not a test): GOPS per core on prefill shapes, interleaved round by round in one process, so the
ratio to fp32 is the result (these machines are shared and noisy). Input: uint8/int8 codes; output:
float with per-channel scales and bias (the NPU region's GEMM without the activation quantization).

    .venv/bin/python benchmarks/bench_int8_paths.py [--m 256] [--paths avx2 onednn] [--json]

Run it under `make test-avx2`'s environment (ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ...)
to see an AVX2-only CPU's fp32 baseline.
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from llmnpu_delegate.kernels import int8_path, ops
from llmnpu_delegate.kernels.native_ops import native_available

SHAPES = [(576, 1536), (1536, 576), (896, 4864), (4864, 896)]     # (K, N) of SmolLM2 and Qwen2-0.5B linears


def _median_s(fn, reps: int) -> float:
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--paths", nargs="*", default=None, help="default: every exact path this CPU runs, but int64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cpu = int8_path.detect()
    paths = args.paths or [p for p in int8_path.PATHS if p != "int64" and int8_path.exact_on(p, cpu)
                           and (p not in int8_path.NATIVE_PATHS or native_available())]
    result = {"cpu": cpu.model, "isa": int8_path.isa_class(cpu), "chosen": int8_path.current(),
              "onednn_cap": cpu.onednn_cap or None, "m": args.m, "shapes": {}}
    for k, n in SHAPES:
        x_q = torch.randint(-127, 128, (args.m, k), dtype=torch.int8)
        x_u8 = (x_q.short() + 128).to(torch.uint8)
        w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        w_scale, bias = torch.rand(n) * 0.01, torch.randn(n)
        xf, wf = x_q.float(), w_q.float()
        fns = {"fp32": lambda: F.linear(xf, wf, bias)}
        for p in paths:
            packed, xin = ops._pack(w_q, p), (x_u8 if ops._wants_u8(p) else x_q)
            fns[p] = lambda p=p, packed=packed, xin=xin: ops._gemm(p, xin, 0.01, packed, n, w_scale, bias)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()                                           # warm-up (and packing)
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(_median_s(fn, args.reps))
        gops = {name: 2 * args.m * k * n / statistics.median(t) / 1e9 for name, t in times.items()}
        result["shapes"][f"{k}x{n}"] = {name: {"gops": round(g, 1), "vs_fp32": round(g / gops["fp32"], 2)}
                                        for name, g in gops.items()}
    names = ["fp32", *paths]
    result["geomean_gops"] = {name: round(statistics.geometric_mean(
        [s[name]["gops"] for s in result["shapes"].values()]), 1) for name in names}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    print(f"{result['cpu']} ({result['isa']}), one thread, M = {args.m}; chosen path: {result['chosen']}"
          + (f"; ONEDNN_MAX_CPU_ISA={cpu.onednn_cap}" if cpu.onednn_cap else ""))
    print(f"{'K x N':<12}" + "".join(f"{name:>16}" for name in names))
    for shape, row in result["shapes"].items():
        print(f"{shape:<12}" + "".join(f"{row[name]['gops']:>8.0f} ({row[name]['vs_fp32']:.2f}x)" for name in names))
    print(f"{'geomean':<12}" + "".join(f"{result['geomean_gops'][name]:>16.0f}" for name in names) + "  GOPS")


if __name__ == "__main__":
    main()
