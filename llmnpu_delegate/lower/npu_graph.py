"""An NPU subgraph that holds more than linears, made runnable on the engine's NPU lane.

Under a placement beyond the paper's (``partitioner/placement.py``) an NPU region also holds norms,
RoPE, attention, residual adds, the gated activation or shadow merges. The engine's stand-in NPU
runs such a region as its own graph: the linears through the backend's INT8 regions (one per group
of linears that read one tensor, so the input is quantized once, as in a linears-only region),
every other op in float with the CPU subgraphs' own rewrites (``fuse.py``), on the NPU lane's
thread; in a quantized engine, the pieces an integer NPU runs at 16-bit activations do so here at
their calibrated encodings (``NpuEncodings``): attention (``kernels/npu_attention.py``) and the
block norms (``kernels/npu_norm.py``); the norm readers' peak products (piece ``peak``) are the
backend's (``PeakProduct``). The other pieces' numbers are those of the same work placed
on the CPU; what moves is which lane runs it.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

from torch import fx, nn

from ..errors import LlmNpuError
from ..kernels.npu_attention import NpuAttention
from ..kernels.npu_norm import NpuNorm, norm_key
from ..partitioner.patterns import rms_norm_chains
from ..partitioner.placement import innermost_module, layer_of
from ..partitioner.regions import ATTENTION_TARGETS, Partition, Subgraph, is_linear, peak_delta, subgraph_module

REGIONS = "llmnpu_linear_regions"     # attribute of the graph: its linear groups' lowered regions by names


@dataclass(frozen=True)
class NpuEncodings:
    """What an NPU graph's pieces run at in a quantized engine: per layer, attention's encodings
    (``AttentionEncodings``); per block norm, (layer, name) -> its ``NormEncodings``. None: that
    piece is not on the NPU (or the engine is the float one)."""
    attention: dict | None = None
    norms: dict | None = None


def holds_more_than_linears(sub: Subgraph) -> bool:
    return any(not is_linear(n) and n.op != "get_attr" for n in sub.nodes)


def lower_graph(partition: Partition, sub: Subgraph, backend, like: fx.GraphModule | None = None,
                encodings: NpuEncodings | None = None) -> fx.GraphModule:
    """``sub`` as a GraphModule whose linears call the backend's regions (``like``'s, where given: a
    tail program's graph of the same subgraph at another row count shares its weights), and whose
    attention and block norms run as an NPU graph computes them, at ``encodings``' of their layer
    where given (the quantized engine; the float one keeps them float)."""
    gm = subgraph_module(partition, sub)
    name_of = dict(zip((n.name for n in sub.nodes if is_linear(n)), sub.linears))
    original = {n.name: n for n in sub.nodes}
    groups: dict[fx.Node, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        if is_linear(node):
            groups.setdefault(node.args[0], []).append(node)
    regions: dict[tuple, nn.Module] = {}
    known = getattr(like, REGIONS, {}) if like is not None else {}
    for i, (x, members) in enumerate(groups.items()):
        names = tuple(name_of[n.name] for n in members)
        if names in known:
            region = known[names]
        else:
            part = Subgraph(sub.index, "npu", sub.layer, True, [x.name], [n.name for n in members], list(names),
                            [original[n.name] for n in members])
            region = backend.lower_npu(part)
        regions[names] = region
        attr = f"linears_{i}"
        gm.add_submodule(attr, region)
        with gm.graph.inserting_before(members[0]):
            call = gm.graph.call_module(attr, (x,))
        for j, node in enumerate(members):
            with gm.graph.inserting_before(node):
                out = gm.graph.call_function(operator.getitem, (call, j))
            node.replace_all_uses_with(out)
            gm.graph.erase_node(node)
    attention = encodings.attention if encodings is not None else None
    for node in list(gm.graph.nodes):
        if attention is not None and node.op == "call_function" and node.target in ATTENTION_TARGETS:
            attr = f"attention_{layer_of(node)}"
            gm.add_submodule(attr, NpuAttention(attention[layer_of(node)]))
            node.op, node.target = "call_module", attr
    if encodings is not None and encodings.norms is not None:
        _norms_at_encodings(gm, encodings.norms)
    _bind_peaks(gm, backend)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    setattr(gm, REGIONS, regions)
    return gm


def _bind_peaks(gm: fx.GraphModule, backend) -> None:
    """Each in-graph peak product (placement piece ``peak``) as the backend's module for its linear."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is peak_delta:
            name = node.args[1]
            attr = "peak_" + name.replace(".", "_")
            gm.add_submodule(attr, backend.peak_module(name))
            node.op, node.target, node.args = "call_module", attr, (node.args[0],)


def _norms_at_encodings(gm: fx.GraphModule, norms: dict) -> None:
    """Each block norm of ``gm`` (``patterns.rms_norm_chains``) as one ``NpuNorm`` call at its encodings."""
    for chain in rms_norm_chains(gm.graph):
        key = norm_key(innermost_module(chain.final)[0])
        if key not in norms:
            raise LlmNpuError(f"an NPU graph's norm ({innermost_module(chain.final)[0] or 'outside any module'}) has no "
                              f"calibrated encodings: its model's block norms are {sorted(norms)[:2]}...")
        attr = f"norm_{key[0]}_{key[1]}"
        gm.add_submodule(attr, NpuNorm(norms[key]))
        with gm.graph.inserting_before(chain.final):
            call = gm.graph.call_module(attr, (chain.x, chain.weight, chain.eps))
        call.meta = dict(chain.final.meta)
        chain.final.replace_all_uses_with(call)
        for node in reversed(chain.nodes):
            gm.graph.erase_node(node)
