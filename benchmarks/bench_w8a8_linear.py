"""W8A8 linear vs fp32 F.linear on one thread (a benchmark, not a test).

Both run in the same process, interleaved round by round, so machine noise hits both alike; the
ratio of medians is the result. The W8A8 time includes quantizing the fp32 activation, the int8
GEMM with int32 accumulation, and dequantizing to fp32 (``llmnpu::w8a8_linear``).

    .venv/bin/python benchmarks/bench_w8a8_linear.py [--m 256 --k 896 --n 4864 --threads 1]
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from llmnpu_delegate import kernels as K
from llmnpu_delegate.quantize import quantize_weight


def timed(fn, reps):
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--m", type=int, default=256)
    ap.add_argument("--k", type=int, default=896)
    ap.add_argument("--n", type=int, default=4864)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    x = torch.randn(args.m, args.k)
    x[:, :8] *= 30  # real LLM activations: a few channels (~1 %) carry most outliers
    w, b = torch.randn(args.n, args.k) * 0.05, torch.randn(args.n)
    w_q, w_scale = quantize_weight(w, "channel")
    x_scale = float(x.abs().max()) / 127
    # with clipping at the 99.5th percentile, ~0.5 % of elements take the float shadow path
    clip = float(x.abs().flatten().kthvalue(int(0.995 * x.numel())).values)
    w_t_rows = w.t().contiguous()

    def fp32():
        F.linear(x, w, b)

    def w8a8():
        K.w8a8_linear(x, x_scale, w_q, w_scale, b)

    def w8a8_shadow():
        y = K.w8a8_linear(x, clip / 127, w_q, w_scale, b)
        ch, res = K.outlier_extract(x, clip)
        K.outlier_compensate(y, res, w_t_rows[ch])

    with torch.inference_mode():
        ref = F.linear(x, w, b)
        err = (K.w8a8_linear(x, x_scale, w_q, w_scale, b) - ref).norm() / ref.norm()
        y = K.w8a8_linear(x, clip / 127, w_q, w_scale, b)
        ch, res = K.outlier_extract(x, clip)
        err_shadow = (K.outlier_compensate(y, res, w_t_rows[ch]) - ref).norm() / ref.norm()
        fns = {"fp32": fp32, "w8a8": w8a8, "w8a8_shadow": w8a8_shadow}
        for fn in fns.values():
            timed(fn, 3)  # warm-up: oneDNN packs the weight on first use
        samples = {k: [] for k in fns}
        for _ in range(args.rounds):
            for k, fn in fns.items():
                samples[k] += timed(fn, args.reps)
    med = {k: statistics.median(v) for k, v in samples.items()}
    gop = 2 * args.m * args.k * args.n / 1e9
    print(json.dumps({
        "shape": f"{args.m}x{args.k} @ {args.k}x{args.n}", "threads": args.threads,
        "fp32_ms": round(med["fp32"] * 1e3, 3), "w8a8_ms": round(med["w8a8"] * 1e3, 3),
        "w8a8_shadow_ms": round(med["w8a8_shadow"] * 1e3, 3),
        "fp32_gops": round(gop / med["fp32"], 1), "w8a8_gops": round(gop / med["w8a8"], 1),
        "speedup_w8a8_vs_fp32": round(med["fp32"] / med["w8a8"], 2),
        "speedup_w8a8_shadow_vs_fp32": round(med["fp32"] / med["w8a8_shadow"], 2),
        "w8a8_relative_error": round(float(err), 5),
        "w8a8_shadow_relative_error": round(float(err_shadow), 5),
    }, indent=1))


if __name__ == "__main__":
    main()
