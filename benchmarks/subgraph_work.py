"""Each side's work in a prefill, with the other side idle: every subgraph of one prompt timed alone.

    .venv/bin/python benchmarks/subgraph_work.py [--model smollm2-135m] [--prompt-len 1024] [--attention bf16 fp32]

``llmnpu bench`` reports busy time with both workers running, so each side's tasks pay for the other's
memory traffic and start with cold caches. This runs the same program in order on one thread, times
each (chunk, subgraph) step on a fresh copy of its inputs (best of 5, so its weights and inputs are
warm), and sums by processor: a lower bound of the work the two-engine split has to balance.
"""
import argparse
import collections
import time

import torch

from llmnpu_delegate import load_model
from llmnpu_delegate.measure.speed import prompt_ids
from llmnpu_delegate.runtime.engine import Prefiller

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--prompt-len", type=int, default=1024)
ap.add_argument("--chunk", type=int, default=256)
ap.add_argument("--attention", nargs="+", default=["bf16", "fp32"], choices=["auto", "fp32", "bf16"])
args = ap.parse_args()

lm = load_model(args.model)
ids = prompt_ids(lm, args.prompt_len)
for attention in args.attention:
    engine = Prefiller(lm, args.chunk, progress=False, attention=attention)
    torch.set_num_threads(1)
    work = collections.Counter()
    with torch.inference_mode():
        for _, step, inputs, _ in engine.program.run_in_order(engine.feeds(ids)):
            fn = engine.program.steps[step].fn
            best = float("inf")
            for _ in range(5):
                fresh = [x.clone() if isinstance(x, torch.Tensor) else x for x in inputs]
                start = time.perf_counter()
                fn(*fresh)
                best = min(best, time.perf_counter() - start)
            work[engine.program.steps[step].sub.kind] += best
    cpu = work["cpu"] + work["shadow"]
    print(f"{lm.spec} {args.prompt_len} tokens, attention {engine.attention}: NPU side {work['npu']:.3f} s, "
          f"CPU side {cpu:.3f} s (shadow {work['shadow']:.3f} s)")
