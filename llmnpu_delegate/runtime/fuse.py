"""Rewrites of a prefill CPU subgraph before it runs: the exported graph spells the float side's
work as chains of small aten ops, each a pass over the chunk's memory and a trip through the Python
interpreter. These swap recognised chains for one native op each (``kernels/native_ops.py``, each
with a torch-ops twin when the library is absent) and drop copies that change nothing. Anything that
does not match exactly stays as exported.
"""
from __future__ import annotations

import operator

import torch
from torch import fx

from ..kernels import native_ops
from ..kernels.attention import chunk_attention_bf16
from ..partitioner.patterns import rms_norm_chains

_aten = torch.ops.aten


def fuse_cpu_subgraph(gm: fx.GraphModule, private: set[str], attention: str = "fp32",
                      copies: dict | None = None) -> None:
    """All rewrites, in place. ``private``: inputs no other subgraph reads (may be overwritten);
    ``attention``: "bf16" swaps attention for the bf16-operand kernel (``kernels/attention.py``) and
    gives the few-row float linears (the LM head) bf16 weights; ``copies``: such weight copies made
    for other graphs of the model, used again (and this graph's added)."""
    _fuse_shadow_merge(gm, private)
    _fuse_rms_norm(gm)
    _fuse_add_rms_norm(gm)
    _add_into_private(gm, private)
    _fuse_activation_mul(gm, private)
    _drop_empty_cat_inputs(gm)
    _fuse_rope(gm)
    if attention == "bf16":
        _bf16_attention(gm)
        _bf16_weight_head(gm, copies)
    _erase_dead(gm)
    gm.recompile()


def _fuse_shadow_merge(gm: fx.GraphModule, private: set[str]) -> None:
    """``y + shadow(x)``, a linear's output plus its shadow product, becomes ``shadow(x, into=y)``:
    the product is added into ``y`` in place as it is computed (no [C, N] product and no add pass;
    rows without an outlier are not touched), when ``y`` is a private input read by nothing else."""
    for add in [n for n in gm.graph.nodes if _plain_add(n)]:
        for y, shadow in (add.args, reversed(add.args)):
            if not (_merges_into(gm, shadow) and len(shadow.users) == 1 and _may_hold_sum(y, add, private)):
                continue
            shadow.kwargs = {"into": y}
            add.replace_all_uses_with(shadow)
            gm.graph.erase_node(add)
            break


def _merges_into(gm: fx.GraphModule, node) -> bool:
    """A bound shadow product (``backends/cpu_int8.ShadowDelta``) not yet merged into anything."""
    return (isinstance(node, fx.Node) and node.op == "call_module" and not node.kwargs and len(node.args) == 1
            and getattr(gm.get_submodule(node.target), "merges_into", False))


def _add_into_private(gm: fx.GraphModule, private: set[str]) -> None:
    """``y + d`` -> ``y.add_(d)`` when ``y`` may hold the sum: e.g. a linear's output and its shadow
    product computed apart (the paper's placement), merged without a new [C, N] buffer. The sum is
    the same; the buffer is then the add's own (``_fuse_activation_mul`` may overwrite it). After
    ``_fuse_add_rms_norm``, which folds such an add into its pass."""
    for add in [n for n in gm.graph.nodes if _plain_add(n)]:
        for y, d in (add.args, reversed(add.args)):
            if not _may_hold_sum(y, add, private):
                continue
            with gm.graph.inserting_before(add):
                summed = gm.graph.call_function(_aten.add_.Tensor, (y, d))
            summed.meta.update(add.meta)
            add.replace_all_uses_with(summed)
            gm.graph.erase_node(add)
            break


def _may_hold_sum(y, add: fx.Node, private: set[str]) -> bool:
    """Whether ``add``'s result may be written into its operand ``y``: a private float32 buffer that
    nothing else reads, of the sum's own shape (no broadcast)."""
    vy, vs = _val(y), _val(add)
    return (_private(y, private) and len(y.users) == 1 and vy is not None and vs is not None
            and vy.dtype == vs.dtype == torch.float32 and vy.shape == vs.shape)


def _private(node, private: set[str]) -> bool:
    """A private input, or a node that returns one it wrote into in place (a merged shadow product,
    an in-place add)."""
    if not isinstance(node, fx.Node):
        return False
    if node.op == "call_module" and "into" in node.kwargs:
        node = node.kwargs["into"]
    elif node.op == "call_function" and node.target == _aten.add_.Tensor:
        node = node.args[0]
    return isinstance(node, fx.Node) and node.op == "placeholder" and node.name in private


_ACTIVATIONS = {_aten.silu.default: _aten.silu_.default, _aten.gelu.default: _aten.gelu_.default}


def _fuse_activation_mul(gm: fx.GraphModule, private: set[str]) -> None:
    """``act(a) * b`` -> ``act_(a).mul_(b)`` when nothing else reads ``a`` or ``act(a)`` (the gate
    projection's output, consumed once): no [C, ffn] temporaries in the gated MLP. SiLU, the common
    case, becomes one in-place pass (``native_ops.silu_mul_``)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _aten.mul.Tensor:
            continue
        act, other = node.args
        if not (isinstance(act, fx.Node) and act.target in _ACTIVATIONS and len(act.users) == 1):
            continue
        src = act.args[0]
        if not (isinstance(src, fx.Node) and len(src.users) == 1 and _private(src, private)):
            continue   # only buffers no other subgraph reads, never a weight or a kept value
        if act.kwargs or len(act.args) != 1:
            continue
        if act.target == _aten.silu.default:
            with gm.graph.inserting_after(node):
                fused = gm.graph.call_function(native_ops.silu_mul_, (src, other))
            node.replace_all_uses_with(fused)
            gm.graph.erase_node(node)
            gm.graph.erase_node(act)
            continue
        act.target = _ACTIVATIONS[act.target]
        with gm.graph.inserting_after(node):
            fused = gm.graph.call_function(_aten.mul_.Tensor, (act, other))
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)


def _bf16_attention(gm: fx.GraphModule) -> None:
    """Attention nodes call the bf16-operand kernel instead of fp32 SDPA (same signature)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.llmnpu.chunk_attention.default:
            node.target = chunk_attention_bf16


HEAD_ROWS = 8   # a float linear on at most this many rows streams its weight: the LM head on the logits row


def _bf16_weight_head(gm: fx.GraphModule, copies: dict | None = None) -> None:
    """A float linear on a few rows (the LM head on the last prompt token, the prefill's final task:
    nothing overlaps it) reads a bf16 copy of its weight (``native_ops.linear_bf16w``): half the
    bytes of a product bound by them. One copy per weight in ``copies`` (a chunk program and its
    tail program share it)."""
    copies = {} if copies is None else copies
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _aten.linear.default:
            continue
        x, w = node.args[0], node.args[1]
        bias = node.args[2] if len(node.args) > 2 else None
        vx = _val(x)
        if not (isinstance(w, fx.Node) and w.op == "get_attr") or vx is None or vx.shape[-1] == 0:
            continue
        weight = operator.attrgetter(w.target)(gm)
        rows = vx.numel() // vx.shape[-1]
        if not isinstance(rows, int) or rows > HEAD_ROWS:
            continue   # a chunk-sized (or past-length-dependent) product: compute-bound, left in fp32
        if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float32 or weight.dim() != 2:
            continue
        name = w.target.replace(".", "_") + "_bf16"
        if not hasattr(gm, name):
            key = (w.target, weight.data_ptr(), tuple(weight.shape))
            if key not in copies:
                copies[key] = weight.detach().to(torch.bfloat16)
            gm.register_buffer(name, copies[key], persistent=False)
        with gm.graph.inserting_before(node):
            copy = gm.graph.get_attr(name)
            fused = gm.graph.call_function(native_ops.linear_bf16w, (x, copy, bias))
        fused.meta = dict(node.meta)
        node.replace_all_uses_with(fused)
        gm.graph.erase_node(node)


def _fuse_rms_norm(gm: fx.GraphModule) -> None:
    """The llama-family RMSNorm as exported (``patterns.rms_norm_chains``: seven aten ops, each a pass
    over the chunk and a trip through the interpreter) becomes one ``native_ops.rms_norm`` call."""
    for chain in rms_norm_chains(gm.graph):
        with gm.graph.inserting_before(chain.final):
            fused = gm.graph.call_function(native_ops.rms_norm, (chain.x, chain.weight, chain.eps))
        fused.meta = dict(chain.final.meta)
        chain.final.replace_all_uses_with(fused)
        for node in reversed(chain.nodes):
            gm.graph.erase_node(node)


_ADDS = (_aten.add.Tensor, operator.add)


def _plain_add(node) -> bool:
    return (isinstance(node, fx.Node) and node.op == "call_function" and node.target in _ADDS
            and len(node.args) == 2 and not node.kwargs and all(isinstance(a, fx.Node) for a in node.args))


def _fuse_add_rms_norm(gm: fx.GraphModule) -> None:
    """The residual add feeding a fused norm, ``rms_norm(to(x + (y [+ shadow delta])))`` with the
    sum also kept (the next residual), becomes one ``native_ops.add_rms_norm`` pass: the sum is
    written once and normed while it is still in cache."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for norm in [n for n in gm.graph.nodes if n.op == "call_function" and n.target is native_ops.rms_norm]:
        x_in, weight, eps = norm.args
        cast = x_in if isinstance(x_in, fx.Node) and x_in.target == _aten.to.dtype else None
        if cast is not None and (cast.args[1:] != (torch.float32,) or cast.kwargs):
            continue
        total = cast.args[0] if cast is not None else x_in
        if not _plain_add(total) or len(total.users) != 1:
            continue
        x, rest = total.args
        y, z = (rest.args if _plain_add(rest) and len(rest.users) == 1 else (rest, None))
        vx, vy, vz = _val(x), _val(y), _val(z)
        if vx is None or vy is None or vx.dtype != torch.float32 or vx.shape != vy.shape or vy.dtype != torch.float32:
            continue
        if z is not None and not (vz is not None and vz.dtype == torch.float32 and (vz.numel() == 1 or vz.shape == vx.shape)):
            continue
        kept = cast if cast is not None else total
        if any(order.get(u, -1) < order[norm] for u in kept.users if u is not norm):
            continue   # the sum is (or may be) read before the norm: the fused op, placed there, would be late
        with gm.graph.inserting_before(norm):
            fused = gm.graph.call_function(native_ops.add_rms_norm, (x, y, z, weight, eps))
            summed = gm.graph.call_function(operator.getitem, (fused, 0))
            normed = gm.graph.call_function(operator.getitem, (fused, 1))
        norm.replace_all_uses_with(normed)
        kept.replace_all_uses_with(summed)
        gm.graph.erase_node(norm)
        for node in (cast, total, rest if z is not None else None):
            if node is not None and not node.users:
                gm.graph.erase_node(node)


def _val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


def _drop_empty_cat_inputs(gm: fx.GraphModule) -> None:
    """``cat([empty, past], dim)``, the exported cache's initial state joined to the past, copies the
    past and changes nothing (cat skips 1-D empty tensors): its consumers read the past itself.
    Only where every consumer copies anyway (another cat, or a rope that appends)."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target != _aten.cat.default:
            continue
        parts = node.args[0]
        kept = [p for p in parts if not (_val(p) is not None and _val(p).dim() == 1 and _val(p).numel() == 0)]
        if len(parts) < 2 or len(kept) != 1:
            continue
        if all(u.op == "call_function" and u.target in (_aten.cat.default, native_ops.rope) for u in node.users):
            node.replace_all_uses_with(kept[0])


def _rotate_half_input(node) -> fx.Node | None:
    """``x`` when ``node`` is ``cat([-x[..., d/2:], x[..., :d/2]], -1)`` (HF's rotate_half), else None."""
    if not (isinstance(node, fx.Node) and node.target == _aten.cat.default and len(node.args[0]) == 2):
        return None
    if (node.args[1] if len(node.args) > 1 else 0) not in (-1, 3):
        return None
    neg, low = node.args[0]
    if not (isinstance(neg, fx.Node) and neg.target == _aten.neg.default):
        return None
    high = neg.args[0]
    if not all(isinstance(n, fx.Node) and n.target == _aten.slice.Tensor for n in (high, low)):
        return None
    x = low.args[0]
    v = _val(x)
    if high.args[0] is not x or v is None or v.dim() != 4:
        return None
    half = v.shape[-1] // 2
    ok_low = list(low.args[1:]) in ([3, 0, half], [-1, 0, half])
    ok_high = high.args[1] in (3, -1) and high.args[2] == half and (len(high.args) < 4 or high.args[3] >= v.shape[-1])
    return x if ok_low and ok_high and v.shape[-1] % 2 == 0 else None


def _fuse_rope(gm: fx.GraphModule) -> None:
    """HF's ``apply_rotary_pos_emb`` as exported, ``x * cos + rotate_half(x) * sin`` (seven ops over
    a strided view), becomes ``native_ops.rope(x, cos, sin)``; when the result is only appended to
    the past K (``cat([past, rotated], -2)``), the append joins the same op."""
    for add in [n for n in gm.graph.nodes if n.op == "call_function" and n.target == _aten.add.Tensor]:
        if len(add.args) != 2 or not all(isinstance(a, fx.Node) and a.target == _aten.mul.Tensor for a in add.args):
            continue
        match = next(((x, cos, sin) for direct, rotated in (add.args, add.args[::-1])
                      for x, cos in (direct.args, direct.args[::-1]) for rot, sin in (rotated.args, rotated.args[::-1])
                      if isinstance(x, fx.Node) and _rotate_half_input(rot) is x
                      and isinstance(cos, fx.Node) and isinstance(sin, fx.Node)), None)
        if match is None:
            continue
        x, cos, sin = match
        vx, vc, vs = _val(x), _val(cos), _val(sin)
        rows = vx.shape[-2] * vx.shape[-1] if vx is not None else None
        if rows is None or vc is None or vs is None or vc.numel() != rows or vs.numel() != rows:
            continue   # cos/sin broadcast per head or per batch: not the one-row-per-position layout
        target, past = add, None
        user = next(iter(add.users)) if len(add.users) == 1 else None
        if (user is not None and user.target == _aten.cat.default and len(user.args[0]) == 2
                and user.args[0][1] is add and (user.args[1] if len(user.args) > 1 else 0) in (-2, 2)):
            target, past = user, user.args[0][0]
        with gm.graph.inserting_before(target):
            fused = gm.graph.call_function(native_ops.rope, (x, cos, sin, past))
        fused.meta = dict(target.meta)
        target.replace_all_uses_with(fused)


_PURE = {_aten.mul.Tensor, _aten.add.Tensor, _aten.cat.default, _aten.neg.default, _aten.slice.Tensor,
         _aten.lift_fresh_copy.default, _aten.detach_.default, _aten.unsqueeze.default}


def _erase_dead(gm: fx.GraphModule) -> None:
    """Nodes the rewrites left without users (``detach_`` only acts on a fresh copy made here)."""
    for node in reversed(list(gm.graph.nodes)):
        if node.users or node.op not in ("call_function", "get_attr"):
            continue
        if node.op == "get_attr" or node.target in _PURE:
            gm.graph.erase_node(node)
