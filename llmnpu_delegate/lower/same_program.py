"""When two CPU subgraphs are the same program: one method serves both.

The chunk step repeats the same float work in every layer: attention over the past holds no weight,
RoPE and the gated activation hold none either, and layers with the same shadow branches (or none)
have the same shape. Lowering each again costs most of an export's time and stores the method twice.
``program_key`` names an exported program by what it computes, not by what its nodes are called:
the operators in order, how they connect, their scalar arguments, every input's shape and dtype
(symbolic sizes included) and every constant's bytes. Equal keys mean the same computation, so the
second subgraph's sidecar entry names the first one's method.
"""
from __future__ import annotations

import hashlib

import torch
from torch import fx
from torch.export import ExportedProgram


def _value(val) -> str:
    """A node's example value as its type, shape and dtype (symbolic sizes by their expression)."""
    if isinstance(val, torch.Tensor):
        return f"T{tuple(str(s) for s in val.shape)}{val.dtype}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_value(v) for v in val) + ")"
    return type(val).__name__


def _arg(a, index: dict[fx.Node, int]) -> str:
    if isinstance(a, fx.Node):
        return f"%{index[a]}"
    if isinstance(a, (list, tuple)):
        return "[" + ",".join(_arg(x, index) for x in a) + "]"
    if isinstance(a, dict):
        return "{" + ",".join(f"{k}:{_arg(v, index)}" for k, v in sorted(a.items())) + "}"
    return repr(a)


def _constant(ep: ExportedProgram, target: str) -> bytes:
    t = ep.state_dict[target] if target in ep.state_dict else ep.constants[target]
    t = t.detach().contiguous().reshape(-1)
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.view(torch.uint8).numpy().tobytes()


def program_key(ep: ExportedProgram) -> str:
    """A digest of what ``ep`` computes, blind to node and constant names."""
    h = hashlib.sha256()
    constants = {s.arg.name: s.target for s in ep.graph_signature.input_specs if s.target is not None}
    index: dict[fx.Node, int] = {}
    for i, node in enumerate(ep.graph.nodes):
        index[node] = i
        line = f"{node.op}|{node.target if node.op != 'placeholder' else node.name in constants}|{_arg(node.args, index)}|" \
               f"{_arg(node.kwargs, index)}|{_value(node.meta.get('val'))}\n"
        h.update(line.encode())
        if node.op == "placeholder" and node.name in constants:
            h.update(_constant(ep, constants[node.name]))
    return h.hexdigest()
