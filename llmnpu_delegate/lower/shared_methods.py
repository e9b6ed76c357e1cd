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

import sympy
import torch
from torch import fx
from torch.export import ExportedProgram


def _size(size, symbols: dict) -> str:
    """A size as text; a symbolic one by its expression over symbols renamed in order of appearance
    (each export numbers its symbols anew: the same past length is ``s40`` in one, ``s22`` in another)."""
    if not isinstance(size, torch.SymInt):
        return str(size)
    expr = size.node.expr
    for sym in sorted(expr.free_symbols, key=str):
        symbols.setdefault(sym, sympy.Symbol(f"p{len(symbols)}", integer=True))
    return str(expr.xreplace(symbols))


def _value(val, symbols: dict) -> str:
    """A node's example value as its type, shape and dtype (symbolic sizes by their expression)."""
    if isinstance(val, torch.Tensor):
        return f"T{tuple(_size(s, symbols) for s in val.shape)}{val.dtype}"
    if isinstance(val, (list, tuple)):
        return "(" + ",".join(_value(v, symbols) for v in val) + ")"
    if isinstance(val, torch.SymInt):
        return "S" + _size(val, symbols)
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
    symbols: dict = {}
    for node in ep.graph.nodes:
        index[node] = len(index)
        what = node.target if node.op != "placeholder" else node.name in constants
        h.update(f"{node.op}|{what}|{_arg(node.args, index)}|{_arg(node.kwargs, index)}|"
                 f"{_value(node.meta.get('val'), symbols)}\n".encode())
        if node.op == "placeholder" and node.name in constants:
            h.update(_constant(ep, constants[node.name]))
    for sym, name in symbols.items():       # the bounds a symbolic size was exported with
        h.update(f"{name}:{ep.range_constraints.get(sym)}\n".encode())
    return h.hexdigest()
