"""What a partition amounts to: subgraph counts, sharing, FLOP share, and memory against the naive
design of one full graph set per chunk position (the paper's Figure 7(b) versus 7(c)).

Memory is counted from the graph itself: weights a subgraph holds (INT8 + scales for NPU
subgraphs, float for CPU ones; tied weights once) and the output buffers it owns.
"""
from __future__ import annotations

import math

import torch

from .regions import Partition, is_linear, node_shape


def _output_bytes(partition: Partition, sub, past: int) -> int:
    """The buffers a compiled subgraph owns: its outputs (its inputs are other graphs' outputs)."""
    by_name = {n.name: n for n in partition.graph_module.graph.nodes}
    total = 0
    for name in sub.outputs:
        val = by_name[name].meta.get("val")
        if isinstance(val, torch.Tensor):
            total += math.prod(node_shape(by_name[name], past)) * val.element_size()
    return total


def _weight_bytes(partition: Partition, sub, quantized: bool, seen: set) -> int:
    """Weights held by ``sub`` that no subgraph counted before (``seen``: tied weights count once)."""
    gm = partition.graph_module
    total = 0
    for node in sub.nodes:
        for arg in node.all_input_nodes:
            if arg.op != "get_attr":
                continue
            t = gm
            for part in arg.target.split("."):
                t = getattr(t, part)
            if not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
                continue
            seen.add(t.data_ptr())
            if sub.kind == "npu" and quantized and is_linear(node) and node.args[1] is arg:
                total += t.numel() + 4 * t.shape[0]           # int8 weight + one fp32 scale per row
            else:
                total += t.numel() * t.element_size()
    return total


def memory_report(partition: Partition, chunk_len: int, prompt_len: int, quantized: bool = True) -> dict:
    """Bytes held by the chunk-sharing design and by one full graph set per chunk position."""
    chunks = math.ceil(prompt_len / chunk_len)
    static = [s for s in partition.subgraphs if s.static]
    dynamic = [s for s in partition.subgraphs if not s.static]
    seen: set = set()
    static_bytes = sum(_weight_bytes(partition, s, quantized, seen) + _output_bytes(partition, s, 0) for s in static)
    # Dynamic subgraphs hold no weights (``seen`` would show any): their output buffers, sized
    # for each chunk position (the K/V they pass on grow with it).
    per_position = [sum(_weight_bytes(partition, s, quantized, seen) + _output_bytes(partition, s, i * chunk_len)
                        for s in dynamic) for i in range(chunks)]
    shared = static_bytes + sum(per_position)
    naive = chunks * static_bytes + sum(per_position)
    return {"prompt_len": prompt_len, "chunk": chunk_len, "chunks": chunks,
            "static_bytes": static_bytes, "dynamic_bytes": sum(per_position),
            "shared_bytes": shared, "naive_bytes": naive, "saved": 1 - shared / naive if naive else 0.0}


def partition_summary(partition: Partition, chunk_len: int, prompt_len: int, quantized: bool = True) -> dict:
    chunks = math.ceil(prompt_len / chunk_len)
    kinds = {}
    for kind in ("npu", "cpu", "shadow"):
        subs = partition.by_kind(kind)
        kinds[kind] = {"subgraphs": len(subs), "static": sum(s.static for s in subs),
                       "dynamic": sum(not s.static for s in subs)}
    static = sum(s.static for s in partition.subgraphs)
    dynamic = len(partition.subgraphs) - static
    return {"subgraphs_per_chunk": len(partition.subgraphs), "kinds": kinds,
            "shared": static, "graphs_for_prompt": static + dynamic * chunks,
            "graphs_naive": len(partition.subgraphs) * chunks,
            "npu_flop_share": partition.npu_flop_share(chunks, chunk_len),
            "placement": str(partition.placement), "shadowed_linears": len(partition.shadowed),
            "memory": memory_report(partition, chunk_len, prompt_len, quantized)}


def format_summary(model: str, s: dict) -> str:
    mib = 2 ** 20
    m = s["memory"]
    lines = [f"partition of {model}: chunk {m['chunk']}, prompt {m['prompt_len']} ({m['chunks']} chunks), "
             f"placement {s['placement']}, {s['shadowed_linears']} linears with a shadow path",
             f"{'kind':<8}{'processor':>10}{'per chunk':>11}{'static':>8}{'dynamic':>9}"]
    for kind, k in s["kinds"].items():
        lines.append(f"{kind:<8}{'npu' if kind == 'npu' else 'cpu':>10}{k['subgraphs']:>11}{k['static']:>8}{k['dynamic']:>9}")
    lines += [f"shared (static) subgraphs: {s['shared']} of {s['subgraphs_per_chunk']} per chunk; graphs for the prompt: "
              f"{s['graphs_for_prompt']} (one set per chunk position: {s['graphs_naive']})",
              f"FLOPs on the NPU: {100 * s['npu_flop_share']:.1f} %",
              f"memory: chunk-sharing {m['shared_bytes'] / mib:.1f} MiB, one graph set per chunk position "
              f"{m['naive_bytes'] / mib:.1f} MiB: {100 * m['saved']:.1f} % saved"]
    return "\n".join(lines)


def format_why(why: dict[str, str], examples: int = 6) -> str:
    """The CPU's nodes grouped by why they are not on the NPU (``Partition.why``), most first; the
    JSON output names every node."""
    groups: dict[str, list[str]] = {}
    for name, reason in why.items():
        groups.setdefault(reason, []).append(name)
    lines = [f"why {len(why)} nodes run on the CPU:"]
    for reason, names in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        more = f", ... ({len(names) - examples} more)" if len(names) > examples else ""
        lines.append(f"{len(names):>6}  {reason}: {', '.join(names[:examples])}{more}")
    return "\n".join(lines)
