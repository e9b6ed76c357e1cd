"""A partitioned chunk step made runnable: one callable per subgraph (the executor schedules them).

Static subgraphs are built once (NPU ones compiled by the backend through the graph cache) and
shared by every chunk. Dynamic subgraphs (attention over the past) hold no weights; on the CPU
their graph is shape-polymorphic in the past length, so one build serves every chunk position
(an NPU backend, which needs static shapes, builds one per position instead).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, fx

from .. import kernels  # noqa: F401  (registers llmnpu ops)
from ..format.tasks import past_name
from ..lower.npu_graph import NpuEncodings, holds_more_than_linears, lower_graph
from ..partitioner.regions import Partition, Subgraph, shadow_delta, subgraph_module
from .fuse import fuse_cpu_subgraph


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


def _private_inputs(sub: Subgraph, nodes: dict[str, fx.Node]) -> set[str]:
    """Inputs of ``sub`` that no other subgraph and no graph output reads, and that are whole buffers:
    not a shadow product, which is a scalar zero when no element crossed the threshold."""
    members = set(sub.nodes)
    return {name for name in sub.inputs
            if nodes[name].op != "placeholder" and nodes[name].target is not shadow_delta
            and all(u in members for u in nodes[name].users)}


def build_steps(partition: Partition, backend, progress: bool = False, attention: str = "fp32",
                like: "ChunkProgram | None" = None, npu: NpuEncodings | None = None) -> tuple[list[Step], dict, dict]:
    """One callable per subgraph, in order: NPU ones lowered by ``backend``, the others as float
    GraphModules with their shadow paths bound and their attention in ``attention`` precision
    ("fp32" or "bf16", see ``kernels/attention.py``). Returns the steps, the bound shadow modules
    and the weight copies the graphs read.
    ``like``: a program of the same subgraphs whose NPU regions, shadow modules and weight copies
    are used again (they take any number of rows): only the CPU graphs are built anew.
    ``npu``: the encodings attention and norms run at where they sit in an NPU graph."""
    from tqdm.auto import tqdm

    shadow: dict[str, torch.nn.Module] = like.shadow if like is not None else {}
    copies: dict = like.copies if like is not None else {}
    steps: list[Step] = []
    by_name = {n.name: n for n in partition.graph_module.graph.nodes}
    for i, sub in enumerate(tqdm(partition.subgraphs, desc="preparing subgraphs", unit="graph", disable=not progress)):
        if sub.kind == "npu" and holds_more_than_linears(sub):     # a placement beyond the paper's
            gm = lower_graph(partition, sub, backend, like.steps[i].fn if like is not None else None, npu)
            fuse_cpu_subgraph(gm, _private_inputs(sub, by_name), attention, copies)   # the CPU's own kernels
            steps.append(Step(sub, gm))
            continue
        if sub.kind == "npu":
            steps.append(Step(sub, like.steps[i].fn if like is not None else backend.lower_npu(sub)))
            continue
        gm = subgraph_module(partition, sub)
        _bind_shadow(gm, backend, shadow)
        fuse_cpu_subgraph(gm, _private_inputs(sub, by_name), attention, copies)
        steps.append(Step(sub, gm))
    return steps, shadow, copies


def same_subgraphs(a: Partition, b: Partition) -> bool:
    """Whether two partitions (of one model at two chunk lengths) cut the step alike: the same
    subgraphs, kinds, linears and values in and out, in the same order."""
    def cut(p: Partition) -> list:
        return [(s.kind, s.static, s.layer, s.inputs, s.outputs, s.linears) for s in p.subgraphs]
    return cut(a) == cut(b) and a.graph_outputs == b.graph_outputs


class ChunkProgram:
    """The steps of one chunk, which of them the logits and the K/V need, and where the outputs are.
    ``build`` makes one from a partition and a backend; a ``.pte`` runner makes one from its methods."""

    def __init__(self, steps: list[Step], graph_outputs: list[str], chunk_len: int, layers: int,
                 shadow: dict | None = None, attention: str = "fp32", copies: dict | None = None,
                 npu: NpuEncodings | None = None):
        self.steps, self.chunk_len, self.shadow = steps, chunk_len, shadow or {}
        self.npu = npu    # what attention and norms run at in NPU graphs (lower/npu_graph.NpuEncodings)
        self.copies = copies if copies is not None else {}   # weight copies the CPU graphs read (fuse.py)
        self.attention = attention      # the CPU subgraphs' attention precision (kernels/attention.py)
        outs = graph_outputs
        self.out_logits, self.out_k, self.out_v = outs[0], outs[1:1 + layers], outs[1 + layers:1 + 2 * layers]
        self.needed_final = self._needed([self.out_logits, *self.out_k, *self.out_v])
        self.needed_kv = self._needed([*self.out_k, *self.out_v])

    @classmethod
    def build(cls, partition: Partition, backend, chunk_len: int, layers: int, progress: bool = False,
              attention: str = "fp32", npu: NpuEncodings | None = None) -> "ChunkProgram":
        steps, shadow, copies = build_steps(partition, backend, progress, attention, npu=npu)
        return cls(steps, partition.graph_outputs, chunk_len, layers, shadow, attention, copies, npu)

    def tail(self, partition: Partition, backend, tail_len: int) -> "ChunkProgram":
        """The same program for chunks of ``tail_len`` rows, from ``partition`` (the step captured
        at that length, cut like this one's): its CPU graphs are its own, its NPU regions and shadow
        paths this program's. A prompt's last few tokens then run as ``tail_len`` rows instead of a
        padded chunk (on an NPU, a second static graph of that length)."""
        steps, _, _ = build_steps(partition, backend, False, self.attention, like=self, npu=self.npu)
        layers = len(self.out_k)
        return ChunkProgram(steps, partition.graph_outputs, tail_len, layers, self.shadow, self.attention,
                            self.copies, self.npu)

    def _needed(self, values: list[str]) -> list[int]:
        want, keep = set(values), []
        for i in reversed(range(len(self.steps))):
            sub = self.steps[i].sub
            if want & set(sub.outputs):
                keep.append(i)
                want |= set(sub.inputs)
        return sorted(keep)

    def run_in_order(self, feeds: list[dict[str, Tensor]]) -> Iterator[tuple[int, int, list, dict]]:
        """Every step of every chunk, in program order, without the executor: yields (chunk, step,
        its inputs, its outputs). For tools that look at each subgraph's data (export, validation).
        The inputs are copies: a CPU subgraph may work in place on its private inputs."""
        handoff = {name: past_name(kind, i) for kind, outs in (("k", self.out_k), ("v", self.out_v))
                   for i, name in enumerate(outs)}
        values: dict = {}
        for c, feed in enumerate(feeds):
            values = {**feed, **{handoff[n]: v for n, v in values.items() if n in handoff}}
            for i, step in enumerate(self.steps):
                inputs = [v.clone() if isinstance(v, Tensor) else v for v in (values[n] for n in step.sub.inputs)]
                outs = step.run(values)
                values.update(outs)
                yield c, i, inputs, outs


def program_digest(program: ChunkProgram) -> str:
    """What the steps compute, as text hashed: the code of every CPU subgraph after its rewrites and
    the boundary of every NPU one. A profile of task times is only valid for the program it timed."""
    h = hashlib.sha256()
    for step in program.steps:
        code = step.fn.code if isinstance(step.fn, fx.GraphModule) else ""
        h.update(f"{step.sub.kind}|{step.sub.inputs}|{step.sub.outputs}|{code}\n".encode())
    return h.hexdigest()[:16]
