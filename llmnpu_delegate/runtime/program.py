"""A partitioned chunk step made runnable: one callable per subgraph (the executor schedules them).

Static subgraphs are built once (NPU ones compiled by the backend through the graph cache) and
shared by every chunk. Dynamic subgraphs (attention over the past) hold no weights; on the CPU
their graph is shape-polymorphic in the past length, so one build serves every chunk position
(an NPU backend, which needs static shapes, builds one per position instead).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, fx

from .. import kernels  # noqa: F401  (registers llmnpu ops)
from ..kernels import native_ops
from ..kernels.attention import chunk_attention_bf16
from ..partitioner.regions import Partition, Subgraph, shadow_delta, subgraph_module


def past_name(kind: str, layer: int) -> str:
    """Input name of one layer's past K (``kind="k"``) or V in the chunk step."""
    return f"past_{kind}_{layer}"


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
    projection's output, consumed once): no [C, ffn] temporaries in the gated MLP. SiLU, the common
    case, becomes one in-place pass (``native_ops.silu_mul_``)."""
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
        if act.target == torch.ops.aten.silu.default:
            with gm.graph.inserting_after(node):
                fused = gm.graph.call_function(native_ops.silu_mul_, (src, other))
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(act)
            continue
        act.target = _ACTIVATIONS[act.target]
        with gm.graph.inserting_after(node):
            fused = gm.graph.call_function(torch.ops.aten.mul_.Tensor, (act, other))
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)
    gm.recompile()


def _bf16_attention(gm: fx.GraphModule) -> None:
    """Attention nodes call the bf16-operand kernel instead of fp32 SDPA (same signature)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.llmnpu.chunk_attention.default:
            node.target = chunk_attention_bf16
    gm.recompile()


_aten = torch.ops.aten


def _only_user(node: fx.Node, target) -> fx.Node | None:
    user = next(iter(node.users)) if len(node.users) == 1 else None
    return user if user is not None and user.op == "call_function" and user.target == target else None


def _fuse_rms_norm(gm: fx.GraphModule) -> None:
    """The llama-family RMSNorm as exported, ``w * to(x * rsqrt(mean(x.pow(2), -1, keepdim) + eps))``
    (seven aten ops, each a pass over the chunk and a trip through the interpreter), becomes one
    ``native_ops.rms_norm`` call. Other norms (Gemma's ``1 + w``, layer norms) do not match and stay."""
    for rsqrt in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _aten.rsqrt.default]:
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
        with gm.graph.inserting_before(final):
            fused = gm.graph.call_function(native_ops.rms_norm, (x, weight, add.args[1]))
        final.replace_all_uses_with(fused)
        for node in (final, cast, scaled, rsqrt, add, mean, pow_):
            if node is not None:
                gm.graph.erase_node(node)
    gm.recompile()


def _private_inputs(sub: Subgraph, nodes: dict[str, fx.Node]) -> set[str]:
    """Inputs of ``sub`` that no other subgraph and no graph output reads."""
    members = set(sub.nodes)
    return {name for name in sub.inputs
            if nodes[name].op != "placeholder" and all(u in members for u in nodes[name].users)}


def build_steps(partition: Partition, backend, progress: bool = False,
                attention: str = "fp32") -> tuple[list[Step], dict]:
    """One callable per subgraph, in order: NPU ones lowered by ``backend``, the others as float
    GraphModules with their shadow paths bound and their attention in ``attention`` precision
    ("fp32" or "bf16", see ``kernels/attention.py``). Returns the steps and the bound shadow modules."""
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
        _fuse_rms_norm(gm)
        if attention == "bf16":
            _bf16_attention(gm)
        steps.append(Step(sub, gm))
    return steps, shadow


class ChunkProgram:
    """The steps of one chunk, which of them the logits and the K/V need, and where the outputs are.
    ``build`` makes one from a partition and a backend; a ``.pte`` runner makes one from its methods."""

    def __init__(self, steps: list[Step], graph_outputs: list[str], chunk_len: int, layers: int,
                 shadow: dict | None = None):
        self.steps, self.chunk_len, self.shadow = steps, chunk_len, shadow or {}
        outs = graph_outputs
        self.out_logits, self.out_k, self.out_v = outs[0], outs[1:1 + layers], outs[1 + layers:1 + 2 * layers]
        self.needed_final = self._needed([self.out_logits, *self.out_k, *self.out_v])
        self.needed_kv = self._needed([*self.out_k, *self.out_v])

    @classmethod
    def build(cls, partition: Partition, backend, chunk_len: int, layers: int, progress: bool = False,
              attention: str = "fp32") -> "ChunkProgram":
        steps, shadow = build_steps(partition, backend, progress, attention)
        return cls(steps, partition.graph_outputs, chunk_len, layers, shadow)

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


def chunk_feeds(ids: Tensor, chunk_len: int, kv) -> list[dict[str, Tensor]]:
    """Per chunk of a checked 1-D prompt: its ids (the last chunk padded with 0 at its end),
    positions and the row whose logits are wanted; the first chunk also gets the empty past K/V
    (later chunks get theirs from the chunk before)."""
    c = chunk_len
    feeds = []
    for position, start in enumerate(range(0, ids.numel(), c)):
        part = ids[start:start + c]
        chunk = torch.nn.functional.pad(part, (0, c - part.numel()))[None]
        feeds.append({"input_ids": chunk, "cache_position": torch.arange(start, start + c),
                      "logits_index": torch.tensor([part.numel() - 1])})
    empty = torch.zeros(1, kv.kv_heads, 0, kv.head_dim)
    feeds[0].update({past_name(kind, i): empty for kind in "kv" for i in range(kv.layers)})
    return feeds
