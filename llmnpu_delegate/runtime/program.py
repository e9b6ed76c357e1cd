"""A partitioned chunk step made runnable: one callable per subgraph (the executor schedules them).

Static subgraphs are built once (NPU ones compiled by the backend through the graph cache) and
shared by every chunk. Dynamic subgraphs (attention over the past) get one instance per chunk
position: it holds no weights, only the score buffer of that position's attention, allocated once
and reused by every prompt (large fresh allocations page-fault on every call otherwise).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor, fx

from .. import kernels  # noqa: F401  (registers llmnpu ops)
from ..partitioner.regions import Partition, Subgraph, _size, shadow_delta, subgraph_module

_ATTENTION = torch.ops.llmnpu.chunk_attention.default


@dataclass
class Step:
    sub: Subgraph
    fn: Callable                                  # fn(*inputs[, workspace]) -> tuple of outputs
    workspace_shape: Callable[[int], tuple] | None = None    # dynamic steps: past length -> buffer shape
    weight_bytes: int = 0                         # compiled or float weights this step holds

    @property
    def static(self) -> bool:
        return self.sub.static


@dataclass
class ProgramStats:
    dynamic_builds: int = 0        # (dynamic subgraph, chunk position) instances built
    workspace_bytes: int = 0       # held by those instances

    def to_dict(self) -> dict:
        return dict(vars(self))


def _bind_shadow(gm: fx.GraphModule, backend, bound: dict) -> None:
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target is shadow_delta:
            name = node.args[1]
            if name not in bound:
                bound[name] = backend.shadow_module(name)
            attr = "shadow_" + name.replace(".", "_")
            if not hasattr(gm, attr):
                gm.add_submodule(attr, bound[name])
            node.op, node.target, node.args = "call_module", attr, (node.args[0],)
    gm.recompile()


def _use_workspace(gm: fx.GraphModule, chunk_len: int) -> Callable[[int], tuple] | None:
    """Route the attention of a dynamic subgraph through a caller-owned score buffer."""
    attn = [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _ATTENTION]
    if not attn:
        return None
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    with gm.graph.inserting_before(first):
        ws = gm.graph.placeholder("workspace")
    shapes = []
    for n in attn:
        q, k = n.args[0].meta["val"].shape, n.args[1].meta["val"].shape
        shapes.append((int(k[1]), int(q[1]) // int(k[1]) * int(q[2]), k[2]))
        n.target = torch.ops.llmnpu.chunk_attention_ws.default
        n.args = (*n.args, ws)
    gm.recompile()
    kvh, rows, length = shapes[0]
    if any(s[:2] != (kvh, rows) for s in shapes):
        raise ValueError("attention nodes of one subgraph differ in shape")
    return lambda past: (kvh, rows, _size(length, past))


class ChunkProgram:
    def __init__(self, partition: Partition, backend, chunk_len: int, layers: int):
        self.partition = partition
        self.chunk_len = chunk_len
        self.stats = ProgramStats()
        self.shadow: dict[str, torch.nn.Module] = {}
        self.steps: list[Step] = []
        for sub in partition.subgraphs:
            if sub.kind == "npu":
                region = backend.lower_npu(sub)
                self.steps.append(Step(sub, region, None, region.weight_bytes))
                continue
            gm = subgraph_module(partition, sub)
            _bind_shadow(gm, backend, self.shadow)
            ws = None if sub.static else _use_workspace(gm, chunk_len)
            params = {id(p): p for n in gm.graph.nodes if n.op == "get_attr"
                      for p in [_attr(gm, n.target)] if isinstance(p, Tensor)}
            self.steps.append(Step(sub, gm, ws, sum(p.numel() * p.element_size() for p in params.values())))
        outs = partition.graph_outputs
        self.out_logits, self.out_k, self.out_v = outs[0], outs[1:1 + layers], outs[1 + layers:1 + 2 * layers]
        self.needed_final = self._needed([self.out_logits, *self.out_k, *self.out_v])
        self.needed_kv = self._needed([*self.out_k, *self.out_v])
        self._instances: dict[int, Tensor] = {}     # chunk position -> workspace

    def _needed(self, values: list[str]) -> list[int]:
        want, keep = set(values), []
        for i in reversed(range(len(self.steps))):
            sub = self.steps[i].sub
            if want & set(sub.outputs):
                keep.append(i)
                want |= set(sub.inputs)
        return sorted(keep)

    def workspace(self, position: int) -> Tensor:
        """The score buffer of chunk ``position``'s attention instances (built on first use)."""
        ws = self._instances.get(position)
        if ws is None:
            past = position * self.chunk_len
            shapes = [s.workspace_shape(past) for s in self.steps if s.workspace_shape is not None]
            numel = max((torch.Size(s).numel() for s in shapes), default=0)
            ws = torch.empty(numel)
            self._instances[position] = ws
            self.stats.dynamic_builds += sum(1 for s in self.steps if not s.static)
            self.stats.workspace_bytes += ws.numel() * ws.element_size()
        return ws

    def call_step(self, i: int, values: dict, position: int) -> dict:
        """Run step ``i`` of chunk ``position`` on ``values`` (its inputs by name); its outputs by name."""
        step = self.steps[i]
        args = [values[name] for name in step.sub.inputs]
        if step.workspace_shape is not None:
            shape = step.workspace_shape(position * self.chunk_len)
            args.append(self.workspace(position)[: torch.Size(shape).numel()].view(shape))
        return dict(zip(step.sub.outputs, step.fn(*args)))

def _attr(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj

