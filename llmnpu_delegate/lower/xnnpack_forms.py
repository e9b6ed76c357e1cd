"""Graph rewrites that keep a float or dynamically quantized method inside XNNPACK's partition.

XNNPACK's partitioner leaves an op it does not take to the portable kernels, and every such op
between two of its ops cuts the method there: one more delegate call per run, one more partition
lowered at export (each pays ExecuTorch's per-partition passes and a walk of the whole graph). The
rewrites here give the same values in forms the partitioner takes. They run on an exported
program's ATen graph, before ``to_edge_transform_and_lower``.
"""
from __future__ import annotations

import math

import torch
from torch import fx


def for_xnnpack(gm: fx.GraphModule) -> dict[str, int]:
    """Every rewrite below on ``gm``, in place; how many nodes each changed."""
    return {"means": last_dim_means_as_pooling(gm), "concats": drop_empty_concats(gm)}


def last_dim_means_as_pooling(gm: fx.GraphModule) -> int:
    """Rewrite each ``mean(x, -1, keepdim=True)`` (the RMS norms) as a mean over the two innermost
    dimensions of a 4-D view, the form XNNPACK lowers (global average pooling): its partitioner takes
    no other mean (an RMS norm between two linears would cut the partition in two). Returns the
    number rewritten."""
    aten = torch.ops.aten
    done = 0
    for node in list(gm.graph.nodes):
        if node.target != aten.mean.dim or len(node.args) < 3 or not node.args[2] or node.kwargs.get("dtype"):
            continue
        x, dims = node.args[0], node.args[1]
        val = x.meta.get("val")
        if val is None or val.dim() < 2 or list(dims) not in ([-1], [val.dim() - 1]):
            continue
        *lead, width = val.shape
        with gm.graph.inserting_before(node):
            flat = gm.graph.call_function(aten.view.default, (x, [1, math.prod(lead), 1, width]))
            flat.meta["val"] = val.reshape(1, math.prod(lead), 1, width)
            pooled = gm.graph.call_function(aten.mean.dim, (flat, [2, 3], True))
            pooled.meta["val"] = flat.meta["val"].mean([2, 3], keepdim=True)
            back = gm.graph.call_function(aten.view.default, (pooled, [*lead, 1]))
            back.meta["val"] = node.meta["val"]
        node.replace_all_uses_with(back)
        gm.graph.erase_node(node)
        done += 1
    gm.recompile()
    return done


def drop_empty_concats(gm: fx.GraphModule) -> int:
    """Replace each ``cat`` whose other inputs are all empty by its one non-empty input: the decode
    step's ``DynamicCache`` starts empty, so every layer's K/V pass through ``cat([empty, new])``,
    which XNNPACK does not take (one input left) and which would cut each layer's partition in two.
    Returns the number replaced."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.target != torch.ops.aten.cat.default:
            continue
        parts = [t for t in node.args[0] if t.meta["val"].numel() > 0]
        if len(parts) == 1 and parts[0].meta["val"].shape == node.meta["val"].shape:
            node.replace_all_uses_with(parts[0])
            gm.graph.erase_node(node)
            done += 1
    gm.recompile()
    return done
