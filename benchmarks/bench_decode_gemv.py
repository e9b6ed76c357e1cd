"""Decode's dynamic INT8 linear for one token, per native ``Int8Gemv`` path this CPU runs, against
fbgemm's dynamic linear and fp32 ``F.linear`` (a benchmark, not a test): microseconds a call and the
weight bytes read per second, interleaved round by round in one process (ratios are the result).

    .venv/bin/python benchmarks/bench_decode_gemv.py [--threads 2] [--json]

Decode reads every weight once a token, so a path is as fast as it streams one byte per weight.
"""
import argparse
import json
import statistics
import warnings

import torch
import torch.nn.functional as F
from bench_int8_paths import _median_s

from llmnpu_delegate.kernels import int8_path
from llmnpu_delegate.kernels.native_ops import native_available
from llmnpu_delegate.quantize.linear import quantize_weight

SHAPES = [(576, 1536), (1536, 576), (576, 49152), (896, 9728)]   # (K, N): SmolLM2's, its LM head, Qwen2-0.5B's


def _fbgemm(w_q, w_scale):
    with warnings.catch_warnings():   # qint8 tensors are deprecated; the packed weight is what we time
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(w_q, w_scale.double(), torch.zeros_like(w_scale, dtype=torch.int64), 0)
        return torch.ops.quantized.linear_prepack(qw, None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if not native_available():
        raise SystemExit("the native kernels are not built: run `make kernels`")
    torch.set_num_threads(args.threads)
    cpu = int8_path.detect()
    wanted = {"vnni": cpu.has("avx512_vnni", "avx512vl"), "avx2": cpu.has("avx2")}   # as detect() sees the CPU
    paths = [p for p, ok in wanted.items() if ok and torch.ops.llmnpu_native.int8_gemv_supported(p)]
    result = {"cpu": cpu.model, "isa": int8_path.isa_class(cpu), "chosen": int8_path.decode_path(cpu),
              "threads": args.threads, "shapes": {}}
    for k, n in SHAPES:
        w = torch.randn(n, k)
        x = torch.randn(1, k)
        w_q, w_scale = quantize_weight(w, "channel")
        packed = _fbgemm(w_q, w_scale)
        fns = {"fp32": lambda: F.linear(x, w),
               "fbgemm": lambda: torch.ops.quantized.linear_dynamic(x, packed, False)}
        for p in paths:
            gemv = torch.classes.llmnpu_native.Int8Gemv(w_q, w_scale, None, p)
            fns[p] = lambda gemv=gemv: torch.ops.llmnpu_native.int8_gemv(gemv, x)
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()
        for _ in range(args.rounds):
            for name, fn in fns.items():
                times[name].append(_median_s(fn, args.reps))
        result["shapes"][f"{k}x{n}"] = {name: {"us": round(statistics.median(t) * 1e6, 1),
                                               "int8_gb_s": round(k * n / statistics.median(t) / 1e9, 1)}
                                        for name, t in times.items()}
    if args.json:
        print(json.dumps(result, indent=1))
        return
    names = ["fp32", "fbgemm", *paths]
    print(f"{result['cpu']} ({result['isa']}), {args.threads} threads, one token; chosen path: {result['chosen']}")
    print(f"{'K x N':<12}" + "".join(f"{name:>18}" for name in names) + "   (us; INT8 weight GB/s)")
    for shape, row in result["shapes"].items():
        print(f"{shape:<12}" + "".join(f"{row[name]['us']:>9.1f} ({row[name]['int8_gb_s']:>5.1f})" for name in names))


if __name__ == "__main__":
    main()
