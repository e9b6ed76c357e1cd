"""How long a subgraph takes on a phone: work counted from the FX graph, priced by a device profile.

Work comes from the shapes of the partitioned chunk step's nodes at a given past length (no
per-model formulas): FLOPs of linears and attention, bytes read and written by every other op,
INT8 weight bytes of the NPU's GEMMs, and for a shadow product the outlier share of its input from
the quantization plan. Float tensors are priced at the device's float width (FP16 on the phone,
paper Table 4), whatever dtype the graph was traced in.

- NPU graph: ``graph_launch + sum over GEMMs of max(flops / matrix rate, weight bytes / weight
  bandwidth) + activation bytes in and out / memory bandwidth``: a roofline GEMM by GEMM, plus the
  shared-memory traffic of the graph's inputs and outputs. Where the placement puts more than
  linears on the NPU: attention's ``Q K^T`` and ``P V`` on the matrix unit at 16-bit activations,
  its softmax and every other piece's output elements on the vector unit, the K/V window read from
  DRAM, as ``whole_npu.py`` prices a whole-NPU program. Attention in a static graph reads a fixed
  window of keys (the context the program was exported for), whatever the chunk's past. The rates are the program's
  (``gemm_rates``): the device's matrix unit at the program's activation precision and its DRAM,
  or the paper's Table 3 roofline for the paper's own implementation. With
  ``fine_share`` of the output channels computed a second time for a finer 8-bit encoding
  (``lower/npu_subgraphs.fine_outputs``), the GEMMs' compute and their outputs' traffic grow by
  that share, and the runner's merge reads both copies and writes one on the CPU's memory.
  A peak product inside the graph (placement piece ``peak``) is two GEMMs at 16-bit activations:
  a one-hot ``[K, PEAK_CHANNELS]`` pick of the peak channels' residues (``x - clip(x)``, made once
  per input on the vector unit: q/k/v share theirs, as do gate/up), and those residues times their
  ``PEAK_CHANNELS`` weight rows; its add, with the linear's output requantized to 16 bits, is one
  more output on the vector unit.
- CPU: each op that does work costs ``op_launch + max(flops / float rate, bytes / memory
  bandwidth)``; views and shape arithmetic are free. A shadow product of a linear absent from the
  plan's outlier shares is a pruned path and costs nothing; an inline product's add is the
  product's own (it adds into the linear's output in place).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from ..families import writes_residual
from ..partitioner.placement import INLINE, MERGE, movable, piece_of
from ..partitioner.regions import (ATTENTION_TARGETS, Subgraph, dim_size, is_linear, node_flops, node_shape, peak_delta,
                                   shadow_delta, weight_name_of)
from ..quantize.shadow_rows import PEAK_CHANNELS
from .device import Device, graph_launch_s, matrix_ops_per_s
from .programs import PROGRAMS, Program

OURS = PROGRAMS["ours"]

# Ops that move no data: views, shape arithmetic, metadata.
FREE_OPS = {"sym_size", "detach", "detach_", "unsqueeze", "squeeze", "view", "_unsafe_view", "transpose",
            "expand", "slice", "reshape", "permute", "select", "getitem", "alias", "t", "arange",
            "_assert_tensor_metadata", "lift_fresh_copy"}


@dataclass
class Work:
    flops: float = 0.0
    bytes: float = 0.0          # activations read + written (float at the device's width)
    weight_bytes: float = 0.0   # INT8 weights streamed (NPU GEMMs)
    ops: int = 0                # ops that do work (each pays a launch on the CPU)

    def __iadd__(self, other: "Work") -> "Work":
        self.flops += other.flops
        self.bytes += other.bytes
        self.weight_bytes += other.weight_bytes
        self.ops += other.ops
        return self


def op_name(node: Node) -> str:
    t = node.target
    if t is operator.add or t is operator.getitem:
        return t.__name__
    name = getattr(t, "__name__", str(t))
    return name.split(".")[0]


def tensor_bytes(val, past: int, float_bytes: float) -> float:
    if not isinstance(val, torch.Tensor):
        return 0.0
    n = math.prod(dim_size(d, past) for d in val.shape)
    return n * (float_bytes if val.dtype.is_floating_point else val.dtype.itemsize)


def _val_bytes(node, past: int, fb: float) -> float:
    if not isinstance(node, Node):
        return 0.0
    val = node.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return sum(tensor_bytes(v, past, fb) for v in vals)


def node_work(node: Node, past: int, float_bytes: float, outlier_rate: dict[str, float]) -> Work:
    """The work of one node at past length ``past``."""
    if node.op != "call_function":
        return Work()
    out_bytes = _val_bytes(node, past, float_bytes)
    if node.target is shadow_delta:
        x, name = node.args
        if name not in outlier_rate:
            return Work()       # a pruned path: it does not run
        xs = node_shape(x, past)
        k, n = xs[-1], node_shape(node, past)[-1]
        elements = math.prod(xs)
        outliers = outlier_rate.get(name, 0.0) * elements
        # threshold test over x, the outlier values times their weight rows, the [C, N] delta out
        rows = min(k, outliers) * n * float_bytes
        return Work(2.0 * outliers * n, elements * float_bytes + rows + out_bytes, 0.0, 1)
    if op_name(node) in FREE_OPS or node.meta.get(MERGE) == INLINE:
        return Work()       # no data moved; an inline merge is the product's own add (runtime/fuse.py)
    in_bytes = sum(_val_bytes(a, past, float_bytes) for a in node.all_input_nodes
                   if a.op != "get_attr" and not (is_linear(node) and a is node.args[1]))
    if is_linear(node):
        k, n = node_shape(node.args[0], past)[-1], node_shape(node, past)[-1]
        return Work(node_flops(node, past), in_bytes + out_bytes, float(k * n), 1)
    if node.target in ATTENTION_TARGETS:
        return Work(node_flops(node, past), in_bytes + out_bytes, 0.0, 1)
    if op_name(node) == "add" and not isinstance(node.meta.get("val"), torch.Tensor):
        return Work()   # SymInt arithmetic
    if op_name(node) == "embedding":
        in_bytes = _val_bytes(node.args[1], past, float_bytes)   # the ids; only the rows read
    return Work(0.0, in_bytes + out_bytes, 0.0, 1)


def subgraph_work(sub: Subgraph, past: int, float_bytes: float, outlier_rate: dict[str, float]) -> Work:
    total = Work()
    for node in sub.nodes:
        total += node_work(node, past, float_bytes, outlier_rate)
    return total


def gemm_rates(device: Device, program: Program) -> tuple[float, float]:
    """(FLOPs per second, weights streamed per second) of an NPU GEMM of ``program``: its matrix rate
    and the DRAM bandwidth over its bytes per weight."""
    if program.rates == "paper":
        return device["paper.int8_ops_per_s"], device["paper.weight_bytes_per_s"] * 8 / program.weight_bits
    return matrix_ops_per_s(device, program.activations), device["npu.dram_bytes_per_s"] * 8 / program.weight_bits


NPU_PARTS = ("launch", "linears", "attention", "softmax", "elementwise", "kv_read", "io", "fine_merge", "peak")
ATTENTION_ACTIVATIONS = "a16"   # Q K^T and P V on the NPU: 8 bits do not hold a softmax's inputs


def _window_past(node: Node, past: int, window: int | None) -> int:
    """The past length at which an NPU attention node reads ``window`` keys: a static graph attends
    over its whole fixed window (masked), whatever part of it holds tokens yet."""
    if window is None:
        return past
    return max(window - node_shape(node.args[0], 0)[2], 0)


def _piece_output(node: Node, piece: str | None) -> bool:
    """Whether ``node`` hands its value out of its piece (to a linear, another piece, a view or the
    graph's outputs): the elements the vector unit writes, once per piece (whole_npu.py, which
    has no graph to look at, counts the gated activation and RoPE twice)."""
    return any(piece_of(u, ATTENTION_TARGETS) != piece or is_linear(u) for u in node.users) or not node.users


def npu_parts(sub: Subgraph, past: int, device: Device, fine_share: float = 0.0, program: Program = OURS,
              window: int | None = None) -> dict[str, float]:
    """Seconds of one execute of the NPU graph ``sub``, per kind (``NPU_PARTS``).

    ``window``: the fixed K/V window of a graph that holds attention (its keys whatever ``past`` is;
    only the chunk's own K/V rows leave the graph, the runner writes them into the window). None:
    shapes at ``past``, as the FX graph has them."""
    fb = device["cpu.float_bytes"]
    rate, weights_per_s = gemm_rates(device, program)
    wide = matrix_ops_per_s(device, program.residual_activations) if program.residual_activations else rate
    vector = device["npu.vector_elems_per_s"]
    rows_past = past if window is None else 0       # the past a graph's own tensors are sized at
    parts = dict.fromkeys(NPU_PARTS, 0.0)
    parts["launch"] = graph_launch_s(device, program.rates)
    io = merge = 0.0
    residues = set()        # inputs whose residues the graph has made (peak products)
    for node in sub.nodes:
        if is_linear(node):
            k, n = node_shape(node.args[0], past)[-1], node_shape(node, past)[-1]
            r = wide if writes_residual(weight_name_of(node) or "") else rate
            parts["linears"] += (1 + fine_share) * max(node_flops(node, past) / r, k * n / weights_per_s)
            out = _val_bytes(node, past, fb)
            io += fine_share * out
            merge += 3 * fine_share * out
        elif node.target is peak_delta:
            parts["peak"] += peak_seconds(node, past, device, node.args[0] not in residues)
            residues.add(node.args[0])
        elif node.target in ATTENTION_TARGETS:
            p = _window_past(node, past, window)
            q, keys = node_shape(node.args[0], p), node_shape(node.args[1], p)[2]
            parts["attention"] += node_flops(node, p) / matrix_ops_per_s(device, ATTENTION_ACTIVATIONS)
            parts["softmax"] += q[1] * q[2] * keys / vector
            kv = sum(math.prod(node_shape(a, p)) for a in node.args[1:3])
            parts["kv_read"] += kv * program.kv_bits / 8 / device["npu.dram_bytes_per_s"]
        elif node.op == "call_function" and node_work(node, rows_past, fb, {}).ops and not movable(node):
            piece = piece_of(node, ATTENTION_TARGETS)
            if _piece_output(node, piece):
                parts["elementwise"] += math.prod(node_shape(node, rows_past)) / vector
    if sub.nodes:   # the graph's float inputs and outputs cross the shared memory
        nodes = {n.name: n for n in sub.nodes[0].graph.nodes}
        io += sum(_val_bytes(nodes[name], rows_past, fb) for name in (*sub.inputs, *sub.outputs))
    parts["io"] = io / device["npu.io_bytes_per_s"]
    parts["fine_merge"] = merge / device["cpu.memory_bytes_per_s"]
    return parts


def peak_seconds(node: Node, past: int, device: Device, residues: bool = True) -> float:
    """One in-graph peak product (``peak_delta``): the one-hot pick of ``PEAK_CHANNELS`` input
    channels and their residues' GEMM, both on the matrix unit at 16-bit activations, and with
    ``residues``, the input's residues (``x - clip(x)``) written by the vector unit."""
    xs = node_shape(node.args[0], past)
    rows, k, n = math.prod(xs[:-1]), xs[-1], node_shape(node, past)[-1]
    flops = 2.0 * rows * PEAK_CHANNELS * (k + n)
    return flops / matrix_ops_per_s(device, "a16") + residues * rows * k / device["npu.vector_elems_per_s"]


def npu_seconds(sub: Subgraph, past: int, device: Device, fine_share: float = 0.0, program: Program = OURS,
                window: int | None = None) -> float:
    return sum(npu_parts(sub, past, device, fine_share, program, window).values())


def cpu_node_seconds(node: Node, past: int, device: Device, outlier_rate: dict[str, float]) -> float:
    w = node_work(node, past, device["cpu.float_bytes"], outlier_rate)
    if not w.ops:
        return 0.0
    return device["cpu.op_launch_s"] + max(w.flops / device["cpu.float_ops_per_s"],
                                           (w.bytes + w.weight_bytes * device["cpu.float_bytes"])
                                           / device["cpu.memory_bytes_per_s"])


def cpu_seconds(sub: Subgraph, past: int, device: Device, outlier_rate: dict[str, float]) -> float:
    return sum(cpu_node_seconds(node, past, device, outlier_rate) for node in sub.nodes)


def cpu_kind(node: Node) -> str:
    """What a CPU node is, for the lanes' breakdown: attention, shadow, linears or elementwise (norms,
    RoPE, residual adds, activations, the embedding)."""
    if node.target in ATTENTION_TARGETS:
        return "attention"
    if node.target is shadow_delta:
        return "shadow"
    return "linears" if is_linear(node) else "elementwise"


def seconds(sub: Subgraph, past: int, device: Device, outlier_rate: dict[str, float],
            fine_share: float = 0.0, program: Program = OURS, window: int | None = None) -> float:
    """Simulated duration of ``sub`` for a chunk whose past holds ``past`` tokens (``fine_share``,
    ``window``: see the module docstring)."""
    if sub.processor == "npu":
        return npu_seconds(sub, past, device, fine_share, program, window)
    return cpu_seconds(sub, past, device, outlier_rate)
