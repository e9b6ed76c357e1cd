"""Shadow outlier paths as plain graph ops, for programs that leave our runtime (``.pte`` files).

For each shadowed linear ``y = linear(x, W)`` the branch adds back what saturation at the NPU's
static scale removed: ``x - clamp(x, -clip, clip)`` (the residue) times ``W``. Two forms:

- dense, ``linear(residue, W)``: a float GEMM as large as the linear itself. ``add_shadow_paths``
  puts it into a whole exported model (``examples/export_pte.py``), and ``llmnpu export
  --shadow-branch dense`` keeps it as the reference form;
- sparse (the paper's, and the ``.pte`` default), ``linear(residue[..., dense], W[:, dense])``:
  only the channels with outliers in a large share of tokens (``quantize/shadow_rows.dense_channels``), a
  small GEMM with static shapes, plus a per-channel flag of which channels crossed the threshold at
  all (``hits``; both passes over the input are operators of the program's own), so that the runner adds the scattered outliers of the other ("cold") channels one
  row per hit, rows it reads off disk, as our engine does.

The branch is marked so the quantizer and the partitioner leave it float.
"""
from __future__ import annotations

import torch
from torch import fx

from ..partitioner.regions import SHADOW_BRANCH, linear_names
from ..quantize.apply import LinearPlan

_aten = torch.ops.aten


def shadow_product(graph: fx.Graph, x: fx.Node, w: fx.Node, clip: float) -> list[fx.Node]:
    """Insert ``linear(x - clamp(x, -clip, clip), w)`` at the graph's insertion point; its nodes, the product last."""
    clipped = graph.call_function(_aten.clamp.default, (x, -clip, clip))
    residue = graph.call_function(_aten.sub.Tensor, (x, clipped))
    return [clipped, residue, graph.call_function(_aten.linear.default, (residue, w))]


# The sparse branch's two passes over the input, as operators of the program's own (one pass each;
# their kernels: runner/ops/shadow.cpp, which both runners load). Here, the same in aten, for export.
def _residue(x: torch.Tensor, clip: float) -> torch.Tensor:
    return x - torch.clamp(x, -clip, clip)


@torch.library.custom_op("llmnpu::shadow_hits", mutates_args=())
def shadow_hits(x: torch.Tensor, clip: float) -> torch.Tensor:
    """max |x - clamp(x, -clip, clip)| per input channel (the last dim) over all rows: [K]."""
    return torch.amax(_residue(x, clip).abs(), list(range(x.dim() - 1)))


@shadow_hits.register_fake
def _(x, clip):
    return x.new_empty(x.shape[-1:])


@torch.library.custom_op("llmnpu::shadow_gather", mutates_args=())
def shadow_gather(x: torch.Tensor, hot: torch.Tensor, clip: float) -> torch.Tensor:
    """The residue ``x - clamp(x, -clip, clip)`` of the input channels ``hot`` [h]: [.., h]."""
    return _residue(torch.index_select(x, -1, hot), clip)


@shadow_gather.register_fake
def _(x, hot, clip):
    return x.new_empty((*x.shape[:-1], hot.shape[0]))


_out_lib = torch.library.Library("llmnpu", "FRAGMENT")
_out_lib.define("shadow_hits.out(Tensor x, float clip, *, Tensor(a!) out) -> Tensor(a!)")
_out_lib.define("shadow_gather.out(Tensor x, Tensor hot, float clip, *, Tensor(a!) out) -> Tensor(a!)")
for _name, _fn in (("shadow_hits.out", lambda x, clip, *, out: out.copy_(shadow_hits(x, clip))),
                   ("shadow_gather.out", lambda x, hot, clip, *, out: out.copy_(shadow_gather(x, hot, clip)))):
    _out_lib.impl(_name, _fn, "CompositeExplicitAutograd")
    _out_lib.impl(_name, lambda *args, out, **kw: out, "Meta")


def residue_hits(graph: fx.Graph, x: fx.Node, clip: float) -> fx.Node:
    """Insert the ``hits`` [K] of ``x``: max |x - clamp(x, -clip, clip)| per input channel, > 0
    exactly where some element of that channel crossed ``clip``. Linears that read one input at one
    clip (q/k/v, gate/up) share them."""
    return graph.call_function(torch.ops.llmnpu.shadow_hits.default, (x, clip))


def dense_product(graph: fx.Graph, x: fx.Node, clip: float, w_hot: fx.Node, hot: fx.Node) -> fx.Node:
    """Insert the static product of the dense channels: ``residue(x)[..., hot] @ w_hot^T``, with
    ``w_hot`` = W[:, hot] [N, h] and ``hot`` [h] int64; returns ``delta`` [.., N]."""
    gathered = graph.call_function(torch.ops.llmnpu.shadow_gather.default, (x, hot, clip))
    return graph.call_function(_aten.linear.default, (gathered, w_hot))


def add_shadow_paths(gm: fx.GraphModule, plans: dict[str, LinearPlan], prefix: str = "") -> list[str]:
    """Add the dense shadow branch after every shadowed linear of ``gm`` (in place); returns their names."""
    graph = gm.graph
    added = []
    for node, name in linear_names(gm, [n for n, p in plans.items() if p.shadow], prefix).items():
        clip = plans[name].clip
        x, w = node.args[0], node.args[1]
        stack = dict(node.meta.get("nn_module_stack") or {})
        path = next(reversed(stack.values()))[0] if stack else name
        stack["llmnpu_shadow"] = (f"{path}.shadow", SHADOW_BRANCH)
        # inserting_before(next) keeps the new nodes in creation order; inserting_after(node)
        # would put each one right after ``node``, i.e. reversed (a use before its definition)
        with graph.inserting_before(node.next):
            branch = shadow_product(graph, x, w, clip)
            total = graph.call_function(_aten.add.Tensor, (node, branch[-1]))
        node.replace_all_uses_with(total, delete_user_cb=lambda u, t=total: u is not t)
        for n in (*branch, total):
            n.meta["nn_module_stack"] = stack
        added.append(name)
    graph.lint()
    gm.recompile()
    return added


def rows_in_program(blocks: dict[str, tuple], named_data: dict[str, tuple[int, int]]) -> dict[str, dict]:
    """Which shadowed linears' cold rows a written program holds itself, and where.

    XNNPACK's serializer keys each constant of a program by the SHA-256 of its bytes, and a weight's
    per-channel scales by ``"scale_"`` and theirs. A dynamically quantized linear's weight is stored
    as the INT8 rows of W^T (``xnnpack_forms.int8_weights_as_rows``; with the float-output methods'
    zero columns, ``npu_subgraphs.SENTINELS`` zero rows after them), the codes and scales of
    ``quantize_weight``: the rows the shadow path reads. ``blocks``: name -> (W [N, K], cold
    channels, clip), as for ``write_cold_rows``; ``named_data``: ``ProgramWriter.write``'s. Returns
    name -> ``rows_offset``, ``scales_offset`` (bytes into the ``.pte``) for those found."""
    import hashlib

    import torch.nn.functional as F

    from ..kernels.ops import quantize_weight
    from .npu_subgraphs import SENTINELS

    def key(t: torch.Tensor) -> str:
        return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()

    found = {}
    for name, (w, _cold, _clip) in blocks.items():
        q, scale = quantize_weight(w.detach().float(), "channel")
        scales = named_data.get("scale_" + key(scale.float()))
        if scales is None or scales[1] != 4 * q.shape[0]:
            continue
        for rows in (q.t(), F.pad(q.t(), (0, 0, 0, SENTINELS))):
            at = named_data.get(key(rows))
            if at is not None and at[1] == rows.numel():
                found[name] = {"rows_offset": at[0], "scales_offset": scales[0]}
                break
    return found
