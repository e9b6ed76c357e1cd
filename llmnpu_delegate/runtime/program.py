"""A partitioned chunk step made runnable: one callable per subgraph (the executor schedules them).

Static subgraphs are built once (NPU ones compiled by the backend through the graph cache) and
shared by every chunk. Dynamic subgraphs (attention over the past) hold no weights; on the CPU
their graph is shape-polymorphic in the past length, so one build serves every chunk position
(an NPU backend, which needs static shapes, builds one per position instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import fx

from .. import kernels  # noqa: F401  (registers llmnpu ops)
from ..partitioner.regions import Partition, Subgraph, shadow_delta, subgraph_module


@dataclass
class Step:
    sub: Subgraph
    fn: Callable                                  # fn(*inputs) -> tuple of outputs

    @property
    def static(self) -> bool:
        return self.sub.static

    def run(self, values: dict) -> dict:
        """Run on ``values`` (its inputs by name); its outputs by name."""
        return dict(zip(self.sub.outputs, self.fn(*[values[name] for name in self.sub.inputs])))


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


_ACTIVATIONS = {torch.ops.aten.silu.default: torch.ops.aten.silu_.default,
                torch.ops.aten.gelu.default: torch.ops.aten.gelu_.default}


def _fuse_activation_mul(gm: fx.GraphModule, private: set[str]) -> None:
    """``act(a) * b`` -> ``act_(a).mul_(b)`` when nothing else reads ``a`` or ``act(a)`` (the gate
    projection's output, consumed once): no [C, ffn] temporaries in the gated MLP."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != torch.ops.aten.mul.Tensor:
            continue
        act, other = node.args
        if not (isinstance(act, fx.Node) and act.target in _ACTIVATIONS and len(act.users) == 1):
            continue
        src = act.args[0]
        if not (isinstance(src, fx.Node) and len(src.users) == 1 and src.op == "placeholder"
                and src.name in private):
            continue   # only buffers no other subgraph reads, never a weight or a kept value
        if act.kwargs or len(act.args) != 1:
            continue
        act.target = _ACTIVATIONS[act.target]
        with gm.graph.inserting_after(node):
            fused = gm.graph.call_function(torch.ops.aten.mul_.Tensor, (act, other))
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
    gm.recompile()


def _private_inputs(sub: Subgraph, nodes: dict[str, fx.Node]) -> set[str]:
    """Inputs of ``sub`` that no other subgraph and no graph output reads."""
    members = set(sub.nodes)
    return {name for name in sub.inputs
            if nodes[name].op != "placeholder" and all(u in members for u in nodes[name].users)}


def build_steps(partition: Partition, backend, progress: bool = False) -> tuple[list[Step], dict]:
    """One callable per subgraph, in order: NPU ones lowered by ``backend``, the others as float
    GraphModules with their shadow paths bound. Returns the steps and the bound shadow modules."""
    from tqdm.auto import tqdm

    shadow: dict[str, torch.nn.Module] = {}
    steps: list[Step] = []
    by_name = {n.name: n for n in partition.graph_module.graph.nodes}
    for sub in tqdm(partition.subgraphs, desc="preparing subgraphs", unit="graph", disable=not progress):
        if sub.kind == "npu":
            steps.append(Step(sub, backend.lower_npu(sub)))
            continue
        gm = subgraph_module(partition, sub)
        _bind_shadow(gm, backend, shadow)
        _fuse_activation_mul(gm, _private_inputs(sub, by_name))
        steps.append(Step(sub, gm))
    return steps, shadow


class ChunkProgram:
    def __init__(self, partition: Partition, backend, chunk_len: int, layers: int, progress: bool = False):
        self.partition = partition
        self.chunk_len = chunk_len
        self.steps, self.shadow = build_steps(partition, backend, progress)
        outs = partition.graph_outputs
        self.out_logits, self.out_k, self.out_v = outs[0], outs[1:1 + layers], outs[1 + layers:1 + 2 * layers]
        self.needed_final = self._needed([self.out_logits, *self.out_k, *self.out_v])
        self.needed_kv = self._needed([*self.out_k, *self.out_v])

    def _needed(self, values: list[str]) -> list[int]:
        want, keep = set(values), []
        for i in reversed(range(len(self.steps))):
            sub = self.steps[i].sub
            if want & set(sub.outputs):
                keep.append(i)
                want |= set(sub.inputs)
        return sorted(keep)

    def call_step(self, i: int, values: dict) -> dict:
        """Run step ``i`` on ``values`` (its inputs by name); its outputs by name."""
        return self.steps[i].run(values)
