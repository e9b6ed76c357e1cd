"""Graph rewrites that keep a float or dynamically quantized method inside XNNPACK's partition.

XNNPACK's partitioner leaves an op it does not take to the portable kernels, and every such op
between two of its ops cuts the method there: one more delegate call per run, one more partition
lowered at export (each pays ExecuTorch's per-partition passes and a walk of the whole graph). The
rewrites here give the same values in forms the partitioner takes. They run on an exported
program's ATen graph, before ``to_edge_transform_and_lower``.
"""
from __future__ import annotations

import math
import operator

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


AS_ROWS = "llmnpu_weight_as_rows"     # node meta flag: a linear whose INT8 weight is stored as W^T rows


def mark_as_rows(nodes) -> None:
    """Flag linear ``nodes`` (before quantization: the flag survives pt2e) for ``int8_weights_as_rows``."""
    for node in nodes:
        node.meta[AS_ROWS] = True


def int8_weights_as_rows(gm: fx.GraphModule) -> int:
    """Rewrite each flagged (``mark_as_rows``) linear with a dynamically quantized input and
    a per-output-channel INT8 weight (a converted pt2e graph, weights folded) as
    ``addmm(b, x, dequantize(W_q^T, axis 1))`` (``b`` its bias, or zeros):
    the same product (XNNPACK's FullyConnected with ``XNN_FLAG_TRANSPOSE_WEIGHTS`` packs either
    layout into the same kernel), but the program then stores each weight as the rows of W^T, so the
    row a shadow path reads for an outlier in input channel c is one contiguous slice of the
    program's own bytes (``format/rows.py``: a program needs no rows file of its own). Flag the
    shadowed linears, in every method that holds them (the float-output NPU methods and the decode
    step), so that their weights stay the same bytes, stored once.
    ``addmm`` and not ``mm``: ExecuTorch's ``mm`` serializer cannot read per-channel scales (it passes
    no program to ``QuantParams``); a zero bias is exact, and equal biases are stored once.
    Returns the number rewritten."""
    aten, qd = torch.ops.aten, torch.ops.quantized_decomposed
    graph, done, flat_inputs = gm.graph, 0, {}
    for node in list(graph.nodes):
        if node.target != aten.linear.default or not node.meta.get(AS_ROWS):
            continue
        x, dq = node.args[0], node.args[1]
        if (getattr(x, "target", None) != qd.dequantize_per_tensor.tensor
                or getattr(dq, "target", None) != qd.dequantize_per_channel.default
                or dq.args[0].op != "get_attr" or dq.args[3] != 0):
            continue
        codes = dq.args[0]
        w = _attr(gm, codes.target)
        if w.dim() != 2 or w.dtype != torch.int8:
            continue
        n, k = w.shape
        stem = codes.target.replace(".", "_")
        gm.register_buffer(f"{stem}_rows", w.t().contiguous())
        bias = node.args[2] if len(node.args) > 2 else None
        if bias is None:
            gm.register_buffer(f"{stem}_zero_bias", torch.zeros(n))
        lead = list(node.meta["val"].shape[:-1])
        with graph.inserting_before(node):
            rows = graph.get_attr(f"{stem}_rows")
            weight = graph.call_function(dq.target, (rows, *dq.args[1:3], 1, *dq.args[4:]), dq.kwargs)
            if len(lead) != 1 and x not in flat_inputs:      # one chain per input (q, k and v share theirs)
                flat_inputs[x] = _flat_dynamic(graph, x, k)
            flat = flat_inputs.get(x, x)
            if bias is None:
                bias = graph.get_attr(f"{stem}_zero_bias")
            product = graph.call_function(aten.addmm.default, (bias, flat, weight))
            out = product if len(lead) == 1 else graph.call_function(aten.view.default, (product, [*lead, n]))
        node.replace_all_uses_with(out)
        graph.erase_node(node)
        if not dq.users:
            graph.erase_node(dq)
        if not codes.users:            # an attribute nothing reads would stay in the program as a constant
            graph.erase_node(codes)
            owner, _, leaf = codes.target.rpartition(".")
            delattr(gm.get_submodule(owner) if owner else gm, leaf)
        done += 1
    graph.eliminate_dead_code()       # the rank-3 quantize chains the flat ones replaced
    graph.lint()
    gm.recompile()
    return done


def _flat_dynamic(graph: fx.Graph, dq: fx.Node, k: int) -> fx.Node:
    """``dq`` (``dequantize(quantize(x, choose_qparams(x)))``) again on ``x`` viewed as [-1, k] rows,
    inserted at the graph's insertion point: XNNPACK's partitioner takes a dynamically quantized
    ``addmm`` only when the chain feeds it directly (a view between them leaves it float)."""
    q = dq.args[0]
    choose = q.args[1].args[0]
    x = graph.call_function(torch.ops.aten.view.default, (q.args[0], [-1, k]))
    chosen = graph.call_function(choose.target, (x, *choose.args[1:]), choose.kwargs)
    scale = graph.call_function(operator.getitem, (chosen, 0))
    zero = graph.call_function(operator.getitem, (chosen, 1))
    codes = graph.call_function(q.target, (x, scale, zero, *q.args[3:]), q.kwargs)
    return graph.call_function(dq.target, (codes, scale, zero, *dq.args[3:]), dq.kwargs)


def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
