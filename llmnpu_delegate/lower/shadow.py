"""Shadow outlier paths as plain graph ops, for programs that leave our runtime (``.pte`` files).

For each shadowed linear ``y = linear(x, W)`` the pass adds the float branch
``y + linear(x - clamp(x, -clip, clip), W)``: the NPU side then sees only ``clamp(x)`` (its static
scale saturates at ``clip``) and the branch adds back exactly what saturation removed. Our engine
computes the same product sparsely (only the channels that crossed the threshold); as a dense graph
op it runs anywhere. The branch is marked so the quantizer and the partitioner leave it float.
"""
from __future__ import annotations

import torch
from torch import fx

from ..partitioner.regions import SHADOW_BRANCH, linear_names
from ..quantize.apply import LinearPlan

_aten = torch.ops.aten


def shadow_product(graph: fx.Graph, x: fx.Node, w: fx.Node, clip: float) -> list[fx.Node]:
    """Insert ``linear(x - clamp(x, -clip, clip), w)`` at the graph's insertion point; its nodes, the product last."""
    clipped = graph.call_function(_aten.clamp.default, (x, -clip, clip))
    residue = graph.call_function(_aten.sub.Tensor, (x, clipped))
    return [clipped, residue, graph.call_function(_aten.linear.default, (residue, w))]


def add_shadow_paths(gm: fx.GraphModule, plans: dict[str, LinearPlan], prefix: str = "") -> list[str]:
    """Add the dense shadow branch after every shadowed linear of ``gm`` (in place); returns their names."""
    graph = gm.graph
    added = []
    for node, name in linear_names(gm, [n for n, p in plans.items() if p.shadow], prefix).items():
        clip = plans[name].clip
        x, w = node.args[0], node.args[1]
        stack = dict(node.meta.get("nn_module_stack") or {})
        path = next(reversed(stack.values()))[0] if stack else name
        stack["llmnpu_shadow"] = (f"{path}.shadow", SHADOW_BRANCH)
        # inserting_before(next) keeps the new nodes in creation order; inserting_after(node)
        # would put each one right after ``node``, i.e. reversed (a use before its definition)
        with graph.inserting_before(node.next):
            branch = shadow_product(graph, x, w, clip)
            total = graph.call_function(_aten.add.Tensor, (node, branch[-1]))
        node.replace_all_uses_with(total, delete_user_cb=lambda u, t=total: u is not t)
        for n in (*branch, total):
            n.meta["nn_module_stack"] = stack
        added.append(name)
    graph.lint()
    gm.recompile()
    return added
