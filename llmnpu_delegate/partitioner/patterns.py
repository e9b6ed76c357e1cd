"""Chains of aten ops that spell one operation of the model, as ``torch.export`` writes them: found
once here, rewritten by whoever needs them (the CPU's fused kernels, ``runtime/fuse.py``; an NPU
graph's encodings, ``lower/npu_graph.py``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import fx

_aten = torch.ops.aten


@dataclass
class RmsNormChain:
    """``weight * to(x * rsqrt(mean(x.pow(2), -1, keepdim) + eps))``: its input, weight (a get_attr),
    eps, the node whose value is the norm (``final``) and every node of the chain."""
    x: fx.Node
    weight: fx.Node
    eps: float
    final: fx.Node
    nodes: list[fx.Node]


def _only_user(node: fx.Node, target) -> fx.Node | None:
    user = next(iter(node.users)) if len(node.users) == 1 else None
    return user if user is not None and user.op == "call_function" and user.target == target else None


def rms_norm_chains(graph: fx.Graph) -> list[RmsNormChain]:
    """The llama-family RMSNorms of ``graph`` (seven aten ops each, the cast optional) whose inner
    values nothing else reads. Other norms (Gemma's ``1 + w``, layer norms) do not match."""
    found = []
    for rsqrt in [n for n in graph.nodes if n.op == "call_function" and n.target == _aten.rsqrt.default]:
        add = rsqrt.args[0]
        if not (isinstance(add, fx.Node) and add.target == _aten.add.Tensor and isinstance(add.args[1], float)):
            continue
        mean = add.args[0]
        if not (isinstance(mean, fx.Node) and mean.target == _aten.mean.dim and list(mean.args[1]) == [-1]
                and (mean.args[2] if len(mean.args) > 2 else mean.kwargs.get("keepdim", False))):
            continue
        pow_ = mean.args[0]
        if not (isinstance(pow_, fx.Node) and pow_.target == _aten.pow.Tensor_Scalar and pow_.args[1] == 2):
            continue
        x = pow_.args[0]
        scaled = _only_user(rsqrt, _aten.mul.Tensor)
        if scaled is None or set(scaled.args) != {x, rsqrt}:
            continue
        cast = _only_user(scaled, _aten.to.dtype)
        if cast is not None and cast.args[1:] != (torch.float32,):
            continue
        final = _only_user(cast if cast is not None else scaled, _aten.mul.Tensor)
        if final is None:
            continue
        weight = next((a for a in final.args if a is not (cast if cast is not None else scaled)), None)
        if not (isinstance(weight, fx.Node) and weight.op == "get_attr"):
            continue
        if any(len(n.users) != 1 for n in (pow_, mean, add)):
            continue
        nodes = [n for n in (pow_, mean, add, rsqrt, scaled, cast, final) if n is not None]
        found.append(RmsNormChain(x, weight, add.args[1], final, nodes))
    return found
