"""An NPU subgraph that holds more than linears, as one method of a cpu-int8 program.

Under a placement beyond the paper's an NPU region also holds norms, RoPE, attention, residual adds,
the gated activation or shadow merges (``partitioner/placement.py``). The engine runs such a region
as a graph (``npu_graph.lower_graph``); the program's method is built from that same graph: each
group of linears that read one tensor becomes a ``FloatOutputRegion`` (XNNPACK's dynamic INT8
linears on our codes: the engine's integer product, with float outputs), attention the engine's NPU
numerics (``kernels/npu_attention.py``) over a symbolic past, the block norms theirs
(``kernels/npu_norm.py``), the peak products the engine's float ones (``PeakProduct``), every other
op float on XNNPACK's kernels. The method takes and returns the subgraph's tensors by name, as a CPU
method does, and a runner calls it on the NPU lane (the sidecar's ``form: graph``).

cpu-int8 with float outputs only: an integer (QNN) graph holding an add would carry the residual
stream, whose outliers no 8-bit encoding holds. QNN writes a norm and the linears it feeds as one
graph of their own (``norm_region.py``).
"""
from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.export import Dim

from ..errors import LlmNpuError
from ..partitioner.placement import Placement
from .cpu_subgraphs import past_dims
from .npu_graph import lower_graph
from .npu_subgraphs import FloatOutputRegion, region_spec
from .xnnpack_forms import for_xnnpack, int8_weights_as_rows, mark_as_rows


# What an integer (QNN) program writes beyond the linears: the block norms, each with the linears it
# feeds as one graph (``norm_region.py``), and RoPE with attention and the linears it feeds
# (``attention_region.py``)
INTEGER_PIECES = frozenset({"norms", "attention", "rope"})


def check_program_placement(placement: Placement, target: str, output_bits: int) -> None:
    """What the program format writes: the paper's split for every target; on cpu-int8 with float
    outputs any placement that keeps each shadow product a task of its own (not ``+inline``), ``fused``
    included; on QNN the norms, RoPE and attention on the NPU too (``attention-half``), and the norm
    readers' peak products in the norms' graphs (``norms+peak``)."""
    if not placement.pieces and not placement.inline:
        return
    if placement.inline:
        # the runner adds a cold channel's product to the product's output; inside a merging task
        # there is none to add it to
        raise LlmNpuError(f"placement {placement}: a program runs each shadow product as its own task (cold rows "
                          f"are added to its output), not inline: drop '+inline' to export")
    if target == "cpu-int8" and output_bits == 32:
        return
    if placement.on_npu("peak") and (target != "qnn" or not placement.on_npu("norms") or placement.on_npu("attention")):
        raise LlmNpuError(f"placement {placement}: an integer program writes the peak products in the norms' graphs "
                          f"of a qnn program beside float attention (--placement norms+peak), and any placement "
                          f"with them for --backend cpu-int8 with float outputs; with attention in the same graph "
                          f"they are not lowered yet (llmnpu simulate prices them): export --placement "
                          f"attention-half or norms+peak, or --backend cpu-int8 --output-bits 32")
    if target != "qnn" or not placement.pieces <= INTEGER_PIECES | {"peak"}:
        raise LlmNpuError(f"placement {placement}: an integer NPU program ({target}, {output_bits}-bit outputs) holds "
                          f"the linears and, on qnn, the norms, RoPE and attention (--placement norms, "
                          f"attention-half); the rest of a block is written for --backend cpu-int8 with float outputs "
                          f"only (an integer graph would carry the residual stream at 8 bits): export --placement "
                          f"paper, norms or attention-half")


class _Rows(nn.Module):
    """A float-output region on [..., in_features] input: flattened to rows, every activation-scale
    group fed the same rows (its linears share one input in the graph), outputs shaped back."""

    def __init__(self, names: list[str], region: FloatOutputRegion, groups: int):
        super().__init__()
        self.names, self.region, self.groups = names, region, groups

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        return tuple(o.reshape(*x.shape[:-1], o.shape[-1]) for o in self.region(*[rows] * self.groups))


class _FloatRegions:
    """What ``lower_graph`` asks of a backend: each group of linears as a float-output region of ``rows`` rows."""

    def __init__(self, engine, rows: int):
        self.engine, self.rows = engine, rows

    def peak_module(self, name: str):
        return self.engine.backend.peak_module(name)

    def lower_npu(self, part) -> _Rows:
        spec = region_spec(f"npu_{part.index}", part.linears, self.engine.plans, flavour="xnnpack")
        linears = [self.engine.backend.linear(n) for n in part.linears]
        return _Rows(list(part.linears), FloatOutputRegion(linears, spec.groups, spec.scales, self.rows),
                     len(spec.groups))


def _hinted(dims: list) -> list:
    """The past's dims (``past_dims``: P or P + a constant, named) as hints with their bounds: under one
    named Dim, export must prove every guard the graph makes for all P at once, and it cannot prove
    some that an NPU graph's mask and attention make (min(P + C, C * (P + C)) == P + C); with hints
    it infers how the sizes relate. The bounds still size the method's memory."""
    return [None if d is None else {k: Dim.AUTO(min=v.min, max=v.max) for k, v in d.items()} for d in dims]


def graph_method(engine, sub, example: tuple, max_past: int):
    """``sub`` (an NPU subgraph of ``engine`` that holds more than linears) as an exported program
    lowered to XNNPACK: its linears at our encodings with float outputs, attention at the engine's
    NPU encodings over a past of up to ``max_past`` positions, its other ops in float."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from ..partitioner.regions import linear_names
    from .encodings import LlmNpuQuantizer

    rows = engine.chunk_len
    gm = lower_graph(engine.partition, sub, _FloatRegions(engine, rows), encodings=engine.program.npu)
    dynamic = None if sub.static else _hinted(past_dims(gm, max_past))
    graph = torch.export.export(gm, example, dynamic_shapes=dynamic, strict=False).module()
    local = {f"{path}.region.lins.{j}": engine.plans[name]
             for path, mod in gm.named_modules() if isinstance(mod, _Rows) for j, name in enumerate(mod.names)}
    found = linear_names(graph, local)
    if len(found) != len(sub.linears):
        raise LlmNpuError(f"NPU subgraph {sub.index}: {len(found)} of its {len(sub.linears)} linears found to quantize")
    if found:       # a region may hold float pieces only (RoPE between two CPU steps)
        mark_as_rows(node for node, name in found.items() if local[name].shadow)
        graph = prepare_pt2e(graph, LlmNpuQuantizer(local, engine.backend.weights, flavour="xnnpack", output_bits=32))
        with torch.no_grad():
            graph(*example)
        graph = convert_pt2e(graph)
        int8_weights_as_rows(graph)     # the shadowed ones, as the decode stores them
    ep = torch.export.export(graph, example, dynamic_shapes=dynamic, strict=False)
    for_xnnpack(ep.graph_module)
    return to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).exported_program("forward")
