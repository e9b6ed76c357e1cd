"""How the decode method carries K/V: what one step copies and costs (``lower/decode_method.py`` chose (a)).

(a) static cache of ``context`` slots, method inputs outside the memory plan: read in place, the new
    token's K/V returned (the program's layout);
(b) the same method with its inputs in the memory plan (ExecuTorch's default): the runtime copies
    every cache tensor into its planned buffer on each call;
(c) K/V as inputs and outputs of a symbolic length P (the prefill chunk step with C = 1): the method
    concatenates past and new, and the whole cache comes back as outputs, which the runner keeps.

Each variant is the fp32 decode step of the model on XNNPACK, one thread, at the same position;
interleaved medians. Usage: python benchmarks/bench_decode_kv.py [--model smollm2-135m] [--context 1024]
"""
from __future__ import annotations

import argparse
import statistics
import time
import warnings

import torch

warnings.simplefilter("ignore")


def program(edge, memory_planned_inputs: bool):
    from executorch.exir import ExecutorchBackendConfig
    from executorch.exir.passes import MemoryPlanningPass
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    config = ExecutorchBackendConfig(memory_planning_pass=MemoryPlanningPass(alloc_graph_input=memory_planned_inputs))
    buffer = edge.to_executorch(config).buffer
    return buffer, _load_for_executorch_from_buffer(buffer)


def main() -> None:
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    from llmnpu_delegate.chunk_step import attention_implementation, export_chunk_step, kv_shape
    from llmnpu_delegate.kernels.attention import decompositions
    from llmnpu_delegate.lower.decode_method import export_decode
    from llmnpu_delegate.models import load_model

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--position", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = load_model(args.model).model.eval()
    kv, ctx, pos = kv_shape(model.config), args.context, args.position
    cache_bytes = 2 * kv.layers * kv.kv_heads * kv.head_dim * 4          # per slot, K and V, fp32
    token = torch.tensor([[7]])

    edge = export_decode(model, kv, ctx, "fp32")
    static = [torch.randn(1, kv.kv_heads, kv.head_dim, ctx) for _ in range(kv.layers)] + \
             [torch.randn(1, kv.kv_heads, ctx, kv.head_dim) for _ in range(kv.layers)]
    keep = {}
    keep["a"] = program(edge, False)
    keep["b"] = program(export_decode(model, kv, ctx, "fp32"), True)
    with attention_implementation(model):
        ep = export_chunk_step(model, 1).run_decompositions(decompositions())
    keep["c"] = program(to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]), True)
    past = [torch.randn(1, kv.kv_heads, pos, kv.head_dim) for _ in range(2 * kv.layers)]

    def step(name):
        pte = keep[name][1]
        if name == "c":
            outs = pte.forward((token, torch.tensor([pos]), torch.tensor([0]), *past))
            return [o.clone() for o in outs[1:]]         # the runner keeps the new whole cache
        return pte.forward((token, torch.tensor([pos]), *static))

    times = {k: [] for k in keep}
    for k in keep:
        step(k)
    for _ in range(args.repeats):
        for k in keep:
            t = time.perf_counter()
            step(k)
            times[k].append(time.perf_counter() - t)
    copied = {"a": kv.layers * 2 * kv.kv_heads * kv.head_dim * 4,
              "b": ctx * cache_bytes + kv.layers * 2 * kv.kv_heads * kv.head_dim * 4,
              "c": (pos + 1) * cache_bytes * 2 + pos * cache_bytes}
    print(f"{args.model}: decode step at position {pos}, context {ctx}, fp32 on XNNPACK, 1 thread, "
          f"median of {args.repeats}")
    base = statistics.median(times["a"])
    for k, label in (("a", "static cache read in place (ours)"), ("b", "static cache, inputs memory-planned"),
                     ("c", "symbolic length in/out (chunk step, C=1)")):
        med = statistics.median(times[k])
        print(f"({k}) {label:<44} {1e3 * med:7.2f} ms  {med / base:5.2f}x   copies ~{copied[k] / 2**20:7.2f} MiB/step")


if __name__ == "__main__":
    main()
