"""RoPE, the chunk's attention and the linears it feeds as one integer NPU graph: a QNN program's
region when the placement puts attention on the NPU (``attention-half``).

The engine's NPU region (``partitioner/regions.npu_regions``: it starts at the q/k/v linears'
outputs) holds the per-head q/k norms where the model has them (Qwen3's), RoPE of q and k, the
write of the chunk's K/V beside the past, the attention, and the linears that read its output
(o_proj, unless a shadow product reads that output too). The graph is that region on static
shapes, as ExecuTorch's Qualcomm llama and Genie build theirs:

- the past K/V as a fixed window of ``window - chunk`` rows (the empty slots anywhere after the
  past), the chunk's new K/V concatenated after it: ``window`` keys, whatever the past;
- the mask an input: ``attention_method.mask_value`` wherever a query may not look (causal, and
  every empty slot), 0 elsewhere (``format/npu_io.window_inputs`` makes both from the step's);
- the q/k norms as HTP's RmsNorm at their 16-bit encodings (``kernels/npu_norm.py``, as a norm
  region's), over each head's last dim;
- attention at ``kernels/npu_attention.py``'s 16-bit encodings (``attention_method.py``'s graph: q
  on its grid after RoPE, the window signed symmetric, the scores, probabilities and output); RoPE's
  own products and sums at 16 bits on a fixed grid that holds any rotated value of q's and the
  window's ranges, q's ending on its grid, K's converted to the window's where it is written;
- the linears as a norm region's (``norm_region.py``): the attention's output clamped to each
  activation group's +-127 codes at 16 bits, then the INT8 region (8-bit outputs, split channel
  groups, second encodings).

Outputs: the chunk's new K and V (on the window's grid; a runner writes them after the past, which
it keeps), the attention's output where a shadow product reads it (16 bits), then the region's
linear parts, which a runner merges as it merges a linears-only method's.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, SharedQuantizationSpec

from .. import backends
from ..errors import LlmNpuError
from ..format.npu_io import RegionSpec
from ..kernels.npu_attention import PROBS, AttentionEncodings, Encoding
from ..kernels.npu_norm import NormEncodings, norm_key
from ..partitioner.patterns import RmsNormChain, rms_norm_chains
from ..partitioner.placement import innermost_module, layer_of, movable, op_name
from ..partitioner.regions import ATTENTION_TARGETS, Partition, Subgraph, is_linear, subgraph_module
from .attention_method import QNN_KV_BITS, AttentionGraph, mask_value, output_of
from .encodings import ANNOTATION, LlmNpuQuantizer, fixed_spec
from .norm_region import annotate_norm
from .npu_subgraphs import Converted, RegionModule, fixed_outputs, lower_converted, output_encodings, plan_names, wide_locals

REGION = "linears.region."      # RegionModule's path inside the static graph

# the float work of RoPE an attention region may hold beside views (HF's rotate_half form)
_ROPE_OPS = {"mul", "neg", "cat", "add", "slice"}
_RMS_NORM = torch.ops.aten.rms_norm.default


@dataclass(frozen=True)
class AttentionRegionShape:
    """An NPU subgraph that is RoPE -> attention (-> linears): names in the subgraph's terms."""
    layer: int
    past: tuple[str, str]           # the inputs holding the past K and V
    present: tuple[str, str]        # the outputs: past and new K, V concatenated
    mask: str                       # the input holding the (boolean) mask
    tables: tuple[str, ...]         # the inputs made outside the blocks: RoPE's cos and sin
    scaling: float
    others: list[str]               # outputs no linear makes beyond the K/V (attention's, for shadows)
    linear_outputs: list[str]
    norms: dict[str, tuple[int, str]]   # "q", "k" -> the per-head norm before RoPE ((layer, name)), if any


def _attention_node(gm: fx.GraphModule) -> fx.Node | None:
    found = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in ATTENTION_TARGETS]
    return found[0] if len(found) == 1 else None


def _kv_write(node: fx.Node) -> tuple[fx.Node, fx.Node] | None:
    """(past placeholder, new rows) of a K/V write ``cat([past, new], dim=2)``."""
    if op_name(node) != "cat" or len(node.args[0]) != 2:
        return None
    dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    past, new = node.args[0]
    return (past, new) if past.op == "placeholder" and dim in (2, -2) else None


def attention_region_shape(partition: Partition, sub: Subgraph) -> AttentionRegionShape | None:
    """``sub`` as RoPE and one attention whose output feeds all of its linears, nothing else in it;
    None for any other subgraph."""
    if sub.kind != "npu":
        return None
    gm = subgraph_module(partition, sub)
    att = _attention_node(gm)
    if att is None or att.args[5] or att.args[3].op != "placeholder":
        return None
    writes = [_kv_write(a) for a in att.args[1:3]]
    if None in writes:
        return None
    linears = [n for n in gm.graph.nodes if is_linear(n)]
    kv = set(att.args[1:3])
    norms = _qk_norms(gm, att)
    if norms is None:
        return None
    in_norms = {n for chain in norms.values() for n in chain.nodes}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node is att or node in kv or node in linears or movable(node) \
                or node in in_norms:
            continue
        if op_name(node) not in _ROPE_OPS or _derives(node, att):
            return None
    if any(not _view_of(lin.args[0], att) for lin in linears):
        return None
    made = {n.name for n in linears}
    present = tuple(a.name for a in att.args[1:3])
    others = [o for o in sub.outputs if o not in made and o not in present]
    if len(others) > 1 or (others and not _view_of(_node(gm, others[0]), att)):
        return None
    past = tuple(w[0].name for w in writes)
    source = {n.name: n for n in partition.graph_module.graph.nodes}
    tables = tuple(i for i in sub.inputs if i not in past and i != att.args[3].name
                   and source[i].op != "placeholder" and layer_of(source[i]) is None)
    keys = {role: norm_key(innermost_module(chain.final)[0]) for role, chain in norms.items()}
    return AttentionRegionShape(layer_of(att) if layer_of(att) is not None else sub.layer, past, present,
                                att.args[3].name, tables, float(att.args[4]), others, [n.name for n in linears], keys)


def _qk_norms(gm: fx.GraphModule, att: fx.Node) -> dict[str, RmsNormChain] | None:
    """"q"/"k" -> the RMSNorm of the region's input that q / the new K is computed from (the q/k
    norms, at most one each, each of a block's own norm); None if a norm is anything else."""
    found = {}
    for chain in rms_norm_chains(gm.graph):
        x = chain.x
        while movable(x) and x.all_input_nodes:
            x = x.all_input_nodes[0]
        roles = [r for r, end in (("q", att.args[0]), ("k", att.args[1])) if _derives(end, chain.final)]
        if x.op != "placeholder" or len(roles) != 1 or roles[0] in found or \
                norm_key(innermost_module(chain.final)[0]) is None:
            return None
        found[roles[0]] = chain
    return found


def _node(gm: fx.GraphModule, name: str) -> fx.Node:
    return next(n for n in gm.graph.nodes if n.name == name)


def _derives(node: fx.Node, source: fx.Node) -> bool:
    """``node`` is ``source`` or computed from it."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is source:
            return True
        if n not in seen:
            seen.add(n)
            todo.extend(n.all_input_nodes)
    return False


def _view_of(node: fx.Node, source: fx.Node) -> bool:
    """``node`` is ``source`` or a chain of views of it."""
    while node is not source:
        if not movable(node) or len(node.all_input_nodes) != 1:
            return False
        node = node.all_input_nodes[0]
    return True


def static_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """``chunk_attention``'s result over a full window: q [1, H, C, d], k/v [1, KVH, W, d], mask
    [1, G*C, W] additive -> [1, C, H, d]. The query heads that share a K/V head are stacked."""
    _, h, c, d = q.shape
    kvh = k.shape[1]
    return output_of(AttentionGraph()(q.reshape(kvh, h // kvh * c, d) * scaling, k[0], v[0], mask), h)


class _ClampedRegion(nn.Module):
    """The linears of an attention region on its output: rows clamped to each activation group's
    +-127 codes (at 16 bits: where HTP requantizes to the group's 8 bits), then ``RegionModule``."""

    def __init__(self, linears: list[nn.Linear], spec: RegionSpec):
        super().__init__()
        self.scales = list(spec.scales)
        self.region = RegionModule(linears, spec.groups, spec.splits, spec.fine)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        rows = x.reshape(-1, x.shape[-1])
        return self.region(*(torch.clamp(rows, -127.0 * s, 127.0 * s) for s in self.scales))


def static_region(partition: Partition, sub: Subgraph, shape: AttentionRegionShape, linears: list[nn.Linear],
                  spec: RegionSpec | None, probe: bool = False) -> fx.GraphModule:
    """The region as a GraphModule on static shapes: the subgraph's inputs by name, the mask additive
    ([1, G*C, W]: ``format/npu_io.window_inputs``); outputs the new K and V, ``shape.others``, then the linears'
    parts (``_ClampedRegion``; none without linears). ``probe``: the linears' input instead of their
    parts (float: what the export chooses their output encodings on)."""
    gm = subgraph_module(partition, sub)
    graph = gm.graph
    att = _attention_node(gm)
    for chain in _qk_norms(gm, att).values():          # one op, as HTP's RmsNorm takes it
        weight = operator.attrgetter(chain.weight.target)(gm)
        with graph.inserting_after(chain.final):
            normed = graph.call_function(F.rms_norm, (chain.x, (weight.shape[-1],), chain.weight, float(chain.eps)))
        chain.final.replace_all_uses_with(normed)
    with graph.inserting_before(att):
        out = graph.call_function(static_attention, (att.args[0], att.args[1], att.args[2], att.args[3],
                                                     shape.scaling))
    att.replace_all_uses_with(out)
    graph.erase_node(att)
    (output,) = [n for n in graph.nodes if n.op == "output"]
    by_name = dict(zip(sub.outputs, output.args[0]))
    news = [_kv_write(_node(gm, name))[1] for name in shape.present]
    region_outs = []
    lin_nodes = [n for n in graph.nodes if is_linear(n)]
    if lin_nodes and probe:
        region_outs = [lin_nodes[0].args[0]]
    elif lin_nodes:
        if spec is None or len({n.args[0] for n in lin_nodes}) != 1:
            raise LlmNpuError(f"attention region of layer {shape.layer}: its linears need one input and a region spec")
        gm.add_submodule("linears", _ClampedRegion(linears, spec))
        with graph.inserting_after(lin_nodes[-1]):
            call = graph.call_module("linears", (lin_nodes[0].args[0],))
        with graph.inserting_after(call):
            region_outs = [graph.call_function(operator.getitem, (call, j)) for j in range(spec.outputs)]
    output.args = (tuple(news) + tuple(by_name[o] for o in shape.others) + tuple(region_outs),)
    for lin in lin_nodes:
        graph.erase_node(lin)
    graph.eliminate_dead_code()
    gm.recompile()
    return gm


def _target(node: fx.Node) -> str:
    return str(node.target).split(".")[-2] if node.op == "call_function" and "." in str(node.target) else ""


class AttentionRegionAnnotation:
    """Fixes the encodings the engine's attention rounds to (``kernels/npu_attention.py``) on the
    static graph's ops, and RoPE's (``_fix_rope``).

    - the q/k norms: theirs (``kernels/npu_norm.py``);
    - the past K/V inputs and the K/V writes (``cat``): the window's grid (the new K converted to it);
    - RoPE's result for q and its scaled copy: q's grid (the scaling folded into the scale);
    - the scores (before and after the mask's add), the probabilities, the output: theirs;
    - the clamps before the linears: the output's grid (HTP requantizes to 8 bits at the linear)."""

    def __init__(self, enc: AttentionEncodings, shape: AttentionRegionShape, norms: dict[str, NormEncodings]):
        self.enc, self.shape, self.norms = enc, shape, norms

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        enc = self.enc
        nodes = [n for n in model.graph.nodes if n.op == "call_function"]
        places = {n.name: n for n in model.graph.nodes if n.op == "placeholder"}
        bmms = [n for n in nodes if _target(n) == "bmm"]
        softmax = [n for n in nodes if "softmax" in _target(n)]
        if len(bmms) != 2 or len(softmax) != 1 or any(p not in places for p in (*self.shape.past, self.shape.mask)):
            raise LlmNpuError(f"unexpected attention region graph of layer {self.shape.layer}: {len(bmms)} bmm, "
                              f"{len(softmax)} softmax")
        qk, pv = bmms
        (soft,) = softmax
        (add,) = [n for n in nodes if _target(n) == "add" and places[self.shape.mask] in n.args]
        scale_q = qk.args[0]                               # q * scaling
        norms = [n for n in nodes if n.target == _RMS_NORM]
        if len(norms) != len(self.shape.norms) or set(self.norms) != set(self.shape.norms):
            raise LlmNpuError(f"attention region graph of layer {self.shape.layer}: {len(norms)} q/k norms, "
                              f"{len(self.shape.norms)} expected, encodings for {sorted(self.norms)}")
        for norm in norms:
            norm_enc = self.norms["q" if _derives(scale_q, norm) else "k"]
            annotate_norm(norm, norm_enc)
            # the views from the region's input keep the norm's input grid (an observed one would
            # clamp a prompt past the calibration's range)
            _fix_producer(norm.args[0], fixed_spec(norm_enc.x), True)
        writes = [next(u for u in places[p].users if _target(u) == "cat") for p in self.shape.past]
        for past, cat, e in zip(self.shape.past, writes, (enc.k, enc.v)):
            spec, past = fixed_spec(e), places[past]
            new = cat.args[0][1]
            cat.meta[ANNOTATION] = QuantizationAnnotation({past: spec, new: spec}, spec, _annotated=True)
            _fix_producer(new, spec, e.signed)
        q_spec = fixed_spec(enc.q)
        # the scaling factor itself (a constant the quantizer lifted) keeps the default's encoding
        kept = dict(scale_q.meta[ANNOTATION].input_qspec_map) if ANNOTATION in scale_q.meta else {}
        scale_q.meta[ANNOTATION] = QuantizationAnnotation({**kept, scale_q.args[0]: q_spec},
                                                          fixed_spec(enc.q, enc.q.scale * self.shape.scaling),
                                                          _annotated=True)
        _fix_producer(scale_q.args[0], q_spec, enc.q.signed)
        # RoPE's products and sums stay within sqrt(2) of the rotated values' largest, where they meet
        # the grid they end on: fixed there, not observed (a prompt past the calibration's ranges
        # would clamp them)
        tables = fixed_spec(Encoding.of_range(-1.0, 1.0, enc.q.bits))
        new_k = writes[0].args[0][1]
        # q's RoPE ends on q's grid; k's on the RoPE grid, converted to the window's signed one after
        for end, e, ends_on_grid in ((scale_q.args[0], enc.q, True), (new_k, enc.k, False)):
            bound = 2 ** 0.5 * max(abs(e.floor), abs((e.codes[1] - e.zero) * e.scale))
            _fix_rope(end, fixed_spec(Encoding.of_range(-bound, bound, enc.q.bits)),
                      {places[t] for t in self.shape.tables if t in places}, tables, ends_on_grid)
        shared = SharedQuantizationSpec
        for mm, e in ((qk, enc.k), (pv, enc.v)):      # the window's views into the product: its grid
            _fix_producer(mm.args[1], fixed_spec(e), True)
        qk.meta[ANNOTATION] = QuantizationAnnotation({scale_q: shared(scale_q), qk.args[1]: shared(qk.args[1])},
                                                     fixed_spec(enc.scores), _annotated=True)
        mask = Encoding.of_range(mask_value(enc), 0.0, enc.scores.bits)
        add.meta[ANNOTATION] = QuantizationAnnotation({qk: shared(qk), places[self.shape.mask]: fixed_spec(mask)},
                                                      fixed_spec(enc.scores), _annotated=True)
        soft.meta[ANNOTATION] = QuantizationAnnotation({add: shared(add)}, fixed_spec(PROBS), _annotated=True)
        pv.meta[ANNOTATION] = QuantizationAnnotation({soft: shared(soft), pv.args[1]: shared(pv.args[1])},
                                                     fixed_spec(enc.out), _annotated=True)
        for clamp in (n for n in nodes if _target(n) == "clamp"):
            clamp.meta[ANNOTATION] = QuantizationAnnotation({clamp.args[0]: fixed_spec(enc.out)},
                                                            fixed_spec(enc.out), _annotated=True)
        return model


def _fix_rope(end: fx.Node, spec, tables: set, table_spec, keep_end: bool) -> None:
    """Every op ``end`` is computed from (RoPE's, within the region, up to a q/k norm, which keeps its
    own) reads and writes ``spec``, the cos/sin ``tables`` theirs; the last op's output keeps its
    annotation if ``keep_end`` (the grid it ends on)."""
    while movable(end) and end.op == "call_function":
        end = end.all_input_nodes[0]
    todo, seen = [end], set()
    while todo:
        node = todo.pop()
        if node in seen or node.op != "call_function" or node.target == _RMS_NORM:
            continue
        seen.add(node)
        old = node.meta.get(ANNOTATION)
        inputs = {a: (table_spec if a in tables else spec) for a in node.all_input_nodes if a.op != "get_attr"}
        out = old.output_qspec if node is end and keep_end and old is not None else spec
        node.meta[ANNOTATION] = QuantizationAnnotation(inputs, out, _annotated=True)
        todo.extend(a for a in node.all_input_nodes if a not in tables)


def _fix_producer(node: fx.Node, spec, signed: bool) -> None:
    """The views that make ``node`` keep ``spec``, and so does the op before them, unless ``spec``
    is signed: RoPE's ops work on the default config's unsigned 16 bits, and HTP's ElementWiseAdd
    refuses an output of another type than its inputs (a conversion follows it instead)."""
    while movable(node) and node.op == "call_function" and node.all_input_nodes:
        src = node.all_input_nodes[0]
        node.meta[ANNOTATION] = QuantizationAnnotation({src: spec}, spec, _annotated=True)
        node = src
    if node.op == "call_function" and not signed:
        old = node.meta.get(ANNOTATION)
        node.meta[ANNOTATION] = QuantizationAnnotation(dict(old.input_qspec_map) if old else {}, spec,
                                                       _annotated=True)


def quantized_attention_region(partition: Partition, sub: Subgraph, shape: AttentionRegionShape,
                               enc: AttentionEncodings, norms: dict[str, NormEncodings], linears: list[nn.Linear],
                               spec: RegionSpec | None, plans: dict, granularity: str, calib: list[tuple],
                               wide: frozenset[str] = frozenset()):
    """The static graph exported, annotated (the attention's, RoPE's and the linears' input encodings
    fixed, and the q/k norms' at ``norms`` by role; the linears' outputs observed over ``calib``, each
    a call's inputs from ``window_inputs``; the linears of ``wide`` at 16 bits), converted (pt2e).
    Returns (graph, example inputs)."""
    from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    if enc.k.bits != QNN_KV_BITS or enc.v.bits != QNN_KV_BITS:
        raise LlmNpuError(f"attention's QNN graph holds a {QNN_KV_BITS}-bit K/V window, not {enc.k.bits}-bit: "
                          f"prepare the engine with npu_kv_bits={QNN_KV_BITS}")
    example = tuple(calib[0])
    graph = torch.export.export(static_region(partition, sub, shape, linears, spec), example, strict=False).module()
    annotations = [AttentionRegionAnnotation(enc, shape, norms)]
    if spec is not None:
        ours = LlmNpuQuantizer({REGION + k: v for k, v in plan_names(spec, plans).items()}, granularity,
                               flavour="qnn", fixed_outputs={REGION + k: v for k, v in fixed_outputs(spec, "qnn").items()},
                               wide=frozenset(REGION + k for k in wide_locals(spec, wide)))
        annotations.insert(0, ours)
    quantizer = backends.get("qnn").quantizer(*annotations)
    quantizer.set_default_quant_config(QuantDtype.use_16a8w)        # 16 bits for what is left (views)
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        for inputs in calib:
            prepared(*inputs)
    return convert_pt2e(prepared), example


def convert_attention_region(method: str, partition: Partition, sub: Subgraph, shape: AttentionRegionShape,
                             enc: AttentionEncodings, norms: dict[str, NormEncodings], linears: list[nn.Linear],
                             spec: RegionSpec | None, plans: dict, granularity: str, calib: list[tuple],
                             wide: frozenset[str] = frozenset()):
    """The region ready to lower to HTP; returns (``Converted``, the encodings of its linears' outputs,
    as ``npu_subgraphs.output_encodings`` gives a linears-only region's)."""
    graph, example = quantized_attention_region(partition, sub, shape, enc, norms, linears, spec, plans, granularity,
                                                calib, wide)
    encodings = output_encodings(graph, 2 + len(shape.others)) if spec is not None else []
    return Converted(spec if spec is not None else RegionSpec(method, [], [], []), graph, example), encodings


def lower_attention_region(method: str, partition: Partition, sub: Subgraph, shape: AttentionRegionShape,
                           enc: AttentionEncodings, norms: dict[str, NormEncodings], linears: list[nn.Linear],
                           spec: RegionSpec | None, plans: dict, granularity: str, calib: list[tuple], soc: str | None):
    """The region lowered alone to one HTP context binary; returns (edge program manager, its encodings)."""
    converted, encodings = convert_attention_region(method, partition, sub, shape, enc, norms, linears, spec, plans,
                                                    granularity, calib)
    return lower_converted([converted], "qnn", soc), encodings


def attention_rows(partition: Partition, sub: Subgraph, shape: AttentionRegionShape, enc: AttentionEncodings,
                   calls: list[tuple]) -> Tensor:
    """What the region's linears read on ``calls`` (``window_inputs``), rows on attention's output grid:
    float attention rounded to it (the NPU's lands within a few steps: ``tests/test_qnn.py``)."""
    probe = static_region(partition, sub, shape, [], None, probe=True)
    with torch.no_grad():
        rows = [probe(*inputs)[-1] for inputs in calls]
    return enc.out.round(torch.cat([r.reshape(-1, r.shape[-1]) for r in rows]))
