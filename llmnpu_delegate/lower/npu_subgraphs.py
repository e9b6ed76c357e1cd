"""The partition's NPU subgraphs as quantized programs with our encodings, one method each.

A static NPU subgraph (the linears that share one input) becomes a method: float input rows
[C, in_features] in, one float output per linear out, integer work in between. Its input and
weight encodings are ours (``encodings.py``): the plan's static activation scale, our symmetric
INT8 weights. Linears of one subgraph whose activation scales differ (a pruned layer beside a
shadowed one) get one method input each: QNN keeps one encoding per tensor. Only the outputs'
encodings are observed, on calibration rows.

Two targets: ``qnn`` (ExecuTorch's Qualcomm delegate, an HTP context binary per method; on this
host it runs on Qualcomm's simulator) and ``cpu-int8`` (XNNPACK's INT8 kernels: the same artefact
without Qualcomm libraries).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import LlmNpuError
from ..quantize.apply import LinearPlan

TARGETS = ("qnn", "cpu-int8")


class RegionModule(nn.Module):
    """One NPU subgraph as a module: ``inputs[g]`` feeds the linears of activation-scale group ``g``."""

    def __init__(self, linears: list[nn.Linear], groups: list[list[int]]):
        super().__init__()
        self.lins = nn.ModuleList(linears)
        self.groups = groups

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        outs: list[Tensor | None] = [None] * len(self.lins)
        for x, idx in zip(inputs, self.groups):
            for i in idx:
                outs[i] = self.lins[i](x)
        return tuple(outs)


@dataclass
class RegionSpec:
    method: str                       # method name in the .pte
    names: list[str]                  # linear names, in output order
    groups: list[list[int]]           # activation-scale groups: indices into names
    scales: list[float]               # one activation scale per group

    def inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        # distinct buffers: the runtime aliases one tensor object passed to two inputs
        return (x, *(x.clone() for _ in self.groups[1:]))


def region_spec(method: str, names: list[str], plans: dict[str, LinearPlan]) -> RegionSpec:
    by_scale: dict[float, list[int]] = {}
    for i, n in enumerate(names):
        by_scale.setdefault(float(plans[n].act_scale), []).append(i)
    return RegionSpec(method, list(names), list(by_scale.values()), list(by_scale))


def quantized_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan], granularity: str,
                     calib_rows: Tensor, target: str = "qnn", rows_per_call: int | None = None):
    """The region exported for ``rows_per_call`` rows (default: all of ``calib_rows``), annotated with
    our encodings, its output encodings observed on every block of ``calib_rows``, converted (pt2e).
    Returns (graph, example inputs)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from .encodings import LlmNpuQuantizer

    n = rows_per_call or calib_rows.shape[0]
    if calib_rows.shape[0] % n:
        raise LlmNpuError(f"{calib_rows.shape[0]} calibration rows are not a whole number of {n}-row calls")
    module = RegionModule(linears, spec.groups).eval()
    example = spec.inputs(calib_rows[:n])
    graph = torch.export.export(module, example, strict=True).module()
    # linears are named lins.<i> inside the module: map them to the plan's entries
    local = {f"lins.{i}": plans[name] for i, name in enumerate(spec.names)}
    ours = LlmNpuQuantizer(local, granularity, flavour="qnn" if target == "qnn" else "xnnpack")
    if target == "qnn":
        from ..qnn.sdk import activate

        activate()      # before the Qualcomm package is imported: it looks for the SDK then
        from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer

        quantizer = QnnQuantizer()
        quantizer.add_custom_quant_annotations((ours.annotate,))
    else:
        quantizer = ours
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for block in calib_rows.split(n):
            prepared(*spec.inputs(block))
    return convert_pt2e(prepared), example


def output_scales(graph) -> list[float]:
    """Per output of a converted region: the scale of the quantize node that encodes it."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    scales = []
    for node in out.args[0]:
        q = node.args[0] if node.op == "call_function" else None    # dequantize(quantize(linear))
        if q is None or "quantize_per_tensor" not in str(q.target):
            raise LlmNpuError(f"region output {node.name} is not quantized")
        scales.append(float(q.args[1]))
    return scales


def lower_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan], granularity: str,
                 calib_rows: Tensor, rows_per_call: int, target: str, soc: str | None = None):
    """One NPU subgraph lowered for ``target`` (``rows_per_call`` rows a call; output encodings from
    ``calib_rows``); returns (edge program manager, its output scales)."""
    if target not in TARGETS:
        raise LlmNpuError(f"unknown target '{target}': use one of {', '.join(TARGETS)}")
    graph, example = quantized_region(spec, linears, plans, granularity, calib_rows, target, rows_per_call)
    scales = output_scales(graph)
    if target == "qnn":
        from .qnn import DEFAULT_SOC, to_qnn_edge

        return to_qnn_edge(spec.method, graph, example, soc or DEFAULT_SOC), scales
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower

    ep = torch.export.export(graph, example, strict=True)
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]), scales
