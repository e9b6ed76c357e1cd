"""The partition's CPU subgraphs as standalone exported programs, for a ``.pte``.

Each CPU (or shadow) subgraph of the chunk step becomes one method. Two things change on the way
out of our runtime: the shadow markers become float branches (``lower/shadow_branches.py``: by default the
sparse hot-channel product, as our engine computes it, with the cold channels left to the runner), and
``llmnpu::chunk_attention`` stays whole where the program's own kernel takes it (``runner/ops/``, which
both runners load), else is decomposed into aten ops. A dynamic subgraph (attention over the
past) keeps the past length symbolic, bounded by the artefact's context, so one method serves
every chunk position; a static one has fixed shapes.
"""
from __future__ import annotations

import warnings

import sympy
import torch
from torch import Tensor, fx
from torch.export import Dim, ExportedProgram

from ..errors import LlmNpuError
from ..format.rows import other_channels
from ..kernels.attention import decompositions, program_kernel_takes
from ..partitioner.regions import Partition, Subgraph, shadow_delta, subgraph_module
from ..quantize.apply import LinearPlan
from .shadow_branches import dense_product, residue_hits, shadow_product
from .embedding_head import half_table_lookups

SHADOW_FORMS = ("sparse", "dense")


def shadow_branches(gm: fx.GraphModule, root: fx.GraphModule, plans: dict[str, LinearPlan], prefix: str,
                    form: str = "sparse") -> tuple[fx.GraphModule, list[dict]]:
    """Replace each ``shadow_delta(x, name)`` marker of a shadow subgraph by a float branch
    (``lower/shadow_branches.py``); weights come from ``root``.

    ``sparse``: the dense channels' static product, and the branch's ``hits`` [K] appended to the
    outputs (one per input and clip: branches reading the same input share it). Returns the module
    and, per shadowed linear, where its input, delta and hits are:
    ``{"linear", "input": input index, "output": output index, "hits": output index or None}``.
    """
    if form not in SHADOW_FORMS:
        raise LlmNpuError(f"unknown shadow branch form '{form}': use one of {', '.join(SHADOW_FORMS)}")
    graph = gm.graph
    inputs = [n for n in graph.nodes if n.op == "placeholder"]
    output = next(n for n in graph.nodes if n.op == "output")
    outs = list(output.args[0])
    branches, extra, shared = [], [], {}
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not shadow_delta:
            continue
        x, name = node.args
        plan = plans[name]
        with graph.inserting_before(node), warnings.catch_warnings():
            warnings.simplefilter("ignore")     # dense: the weight is not on ``gm`` yet: the rebuild copies it
            if form == "dense":
                delta, hits = shadow_product(graph, x, graph.get_attr(f"{prefix}{name}.weight"), plan.clip)[-1], None
            else:
                if (x, plan.clip) not in shared:
                    shared[x, plan.clip] = len(output.args[0]) + len(extra)
                    extra.append(residue_hits(graph, x, plan.clip))
                hits = shared[x, plan.clip]
                hot = program_hot_channels(plan)
                attr = "shadow_" + name.replace(".", "_")
                weight = root.get_submodule(f"{prefix}{name}").weight.detach().float()
                gm.register_buffer(f"{attr}_w", weight[:, hot].contiguous())
                gm.register_buffer(f"{attr}_hot", hot)
                delta = dense_product(graph, x, plan.clip, graph.get_attr(f"{attr}_w"), graph.get_attr(f"{attr}_hot"))
        node.replace_all_uses_with(delta)
        graph.erase_node(node)
        entry = {"linear": name, "input": inputs.index(x), "output": outs.index(node) if node in outs else None,
                 "hits": hits}
        outs = [delta if o is node else o for o in outs]
        branches.append(entry)
    output.args = (tuple(outs) + tuple(extra),)
    out = fx.GraphModule(root if form == "dense" else gm, graph)   # copies the weights the graph reads
    out.graph.lint()
    return out, branches


def program_hot_channels(plan: LinearPlan) -> Tensor:
    """The channels the program multiplies densely (the plan's ``dense``); a static product needs at
    least one column, so channel 0 stands in for none (its residue is exact like any other's)."""
    hot = plan.dense if plan.dense is not None and plan.dense.numel() else torch.zeros(1, dtype=torch.int64)
    return hot.to(torch.int64).clone()


def cold_channels(plan: LinearPlan, in_features: int) -> list[int]:
    """Input channels of a shadowed linear whose rows are not in the program (read from disk when hit)."""
    return other_channels(program_hot_channels(plan), in_features).tolist()


def past_dims(gm: fx.GraphModule, max_past: int) -> list[dict | None]:
    """Per input: the symbolic dims of the chunk step (the past length P, or P + a constant)."""
    past = Dim("past", min=0, max=max_past)
    specs = []
    for node in gm.graph.nodes:
        if node.op != "placeholder":
            continue
        val = node.meta.get("val")
        spec = {}
        for i, size in enumerate(getattr(val, "shape", ())):
            if not isinstance(size, torch.SymInt):
                continue
            expr = size.node.expr
            symbols = expr.free_symbols
            offset = expr - next(iter(symbols)) if len(symbols) == 1 else None
            if offset is None or not isinstance(offset, sympy.Integer):
                raise LlmNpuError(f"input {node.name} has size {expr}: only P or P + constant is supported")
            spec[i] = past if offset == 0 else past + int(offset)
        specs.append(spec or None)
    return specs


def export_cpu_subgraph(partition: Partition, sub: Subgraph, plans: dict[str, LinearPlan] | None, prefix: str,
                        example: tuple[Tensor, ...], max_past: int,
                        shadow: str = "sparse", half_table: bool = False) -> tuple[ExportedProgram, list[dict]]:
    """``sub`` as an ExportedProgram in core aten ops and the program's own operators (``runner/ops/``),
    traced on ``example`` (its inputs at a past length > 1, so the past dimension is not specialised),
    and its shadow branches (``shadow_branches``; empty for other subgraphs). ``half_table``: embedding
    lookups read a float16 table (``embedding_head.py``)."""
    gm = subgraph_module(partition, sub)
    if half_table:
        half_table_lookups(gm)
    branches: list[dict] = []
    if any(n.target is shadow_delta for n in gm.graph.nodes):
        if plans is None:
            raise LlmNpuError("shadow subgraph without a quantization plan")
        gm, branches = shadow_branches(gm, partition.graph_module, plans, prefix, shadow)
    dynamic = past_dims(gm, max_past) if not sub.static else None
    with warnings.catch_warnings():
        # the copied nodes name the model's modules, which a subgraph module does not hold
        warnings.filterwarnings("ignore", message="Failed to fetch module")
        ep = torch.export.export(gm, tuple(example), dynamic_shapes=dynamic, strict=False)
    return ep.run_decompositions(decompositions(keep_attention=_kernel_takes_all(ep.graph_module))), branches


def _kernel_takes_all(gm: fx.GraphModule) -> bool:
    """Whether every attention of the method can run on the program's kernel (runner/ops/): then the
    op stays whole, else it is decomposed into XNNPACK's float ops."""
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.llmnpu.chunk_attention.default]
    return bool(calls) and all(
        n.args[0].meta["val"].dtype == torch.float32 and n.args[3].meta["val"].dtype in (torch.bool, torch.float32)
        and program_kernel_takes(n.args[0].meta["val"].shape, n.args[3].meta["val"].shape, n.args[5]) for n in calls)
