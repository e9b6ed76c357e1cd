"""The partition's CPU subgraphs as standalone exported programs, for a ``.pte``.

Each CPU (or shadow) subgraph of the chunk step becomes one method. Two things change on the way
out of our runtime: the shadow markers become dense float branches ``linear(x - clamp(x), W)``
(``lower/shadow.py``'s arithmetic; our engine computes the same product sparsely), and
``llmnpu::chunk_attention`` is decomposed into aten ops. A dynamic subgraph (attention over the
past) keeps the past length symbolic, bounded by the artefact's context, so one method serves
every chunk position; a static one has fixed shapes.
"""
from __future__ import annotations

import warnings

import sympy
import torch
from torch import Tensor, fx
from torch.export import Dim, ExportedProgram

from ..errors import LlmNpuError
from ..kernels.attention import decompositions
from ..partitioner.regions import Partition, Subgraph, shadow_delta, subgraph_module
from ..quantize.apply import LinearPlan
from .shadow import shadow_product


def dense_shadow(gm: fx.GraphModule, root: fx.GraphModule, plans: dict[str, LinearPlan], prefix: str) -> fx.GraphModule:
    """Replace each ``shadow_delta(x, name)`` marker by the dense float product (``lower/shadow.py``);
    the weights come from ``root``."""
    graph = gm.graph
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not shadow_delta:
            continue
        x, name = node.args
        clip = plans[name].clip
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")     # the weight is not on ``gm`` yet: the rebuild below copies it
            w = graph.get_attr(f"{prefix}{name}.weight")
            delta = shadow_product(graph, x, w, clip)[-1]
        node.replace_all_uses_with(delta)
        graph.erase_node(node)
    out = fx.GraphModule(root, graph)   # copies the weights the graph now reads
    out.graph.lint()
    return out


def _dims(gm: fx.GraphModule, max_past: int) -> list[dict | None]:
    """Per input: the symbolic dims of the chunk step (the past length P, or P + a constant)."""
    past = Dim("past", min=0, max=max_past)
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        spec = {}
        for i, size in enumerate(getattr(val, "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            symbols = expr.free_symbols
            offset = expr - next(iter(symbols)) if len(symbols) == 1 else None
            if offset is None or not isinstance(offset, sympy.Integer):
                raise LlmNpuError(f"input {node.name} has size {expr}: only P or P + constant is supported")
            spec[i] = past if offset == 0 else past + int(offset)
        specs.append(spec or None)
    return specs


def export_cpu_subgraph(partition: Partition, sub: Subgraph, plans: dict[str, LinearPlan] | None, prefix: str,
                        example: tuple[Tensor, ...], max_past: int) -> ExportedProgram:
    """``sub`` as an ExportedProgram in core aten ops (no llmnpu ops), traced on ``example`` (its
    inputs at a past length > 1, so the past dimension is not specialised)."""
    gm = subgraph_module(partition, sub)
    if any(n.target is shadow_delta for n in gm.graph.nodes):
        if plans is None:
            raise LlmNpuError("shadow subgraph without a quantization plan")
        gm = dense_shadow(gm, partition.graph_module, plans, prefix)
    dynamic = _dims(gm, max_past) if not sub.static else None
    with warnings.catch_warnings():
        # the copied nodes name the model's modules, which a subgraph module does not hold
        warnings.filterwarnings("ignore", message="Failed to fetch module")
        ep = torch.export.export(gm, tuple(example), dynamic_shapes=dynamic, strict=False)
    return ep.run_decompositions(decompositions())
