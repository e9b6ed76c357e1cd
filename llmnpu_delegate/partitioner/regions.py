"""The partitioner's core: one pass over an FX ``GraphModule`` that cuts a chunk step into
NPU and CPU subgraphs.

NPU regions hold the decoder blocks' quantizable linears, grouped when they read the same tensor
(q/k/v share one quantized input, as do gate/up), and the block pieces a ``Placement`` sends to the
NPU with them (``placement.py``: attention, norms, RoPE, residual adds, the gated activation, the
merge of a shadow product, the norm readers' products over peak channels). With the paper's
placement (the default) a region is one quantize at its entry, INT8 GEMMs and a dequantize at its
exit, and everything else is float work for the CPU: embedding, RoPE, attention with its KV, masks,
norms, the shadow outlier path and lm_head. The shadow products stay on the CPU, but for the norm
readers' under piece ``peak``.

CPU work is placed *as late as possible*: a node joins the CPU subgraph just before its first
consumer, so e.g. the K/V concatenation of layer 5 lands in layer 5's attention subgraph rather
than at the top of the graph. A subgraph is **dynamic** when a tensor in it has a shape that
depends on the past length (the attention over P+C keys), **static** otherwise (shareable by every
chunk). The pass works on any FX graph whose linears are ``aten.linear`` / ``F.linear`` calls with
resolvable weight names: ``torch.export`` graphs (lifted or not) and Dynamo graphs.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, field
from typing import Iterable

import torch
from torch import fx
from torch.fx import Node

from .. import kernels  # noqa: F401  (registers the llmnpu ops this pass recognizes)
from ..errors import LlmNpuError
from .placement import INLINE, MERGE, PAPER, PEAK, Placement, layer_of, movable, parse_placement, piece_of

SHADOW_BRANCH = "ShadowPath"   # nn_module_stack class of a dense shadow branch (lower/shadow_branches.py): stays float
_LINEAR_TARGETS = {torch.ops.aten.linear.default, torch._C._nn.linear, torch.nn.functional.linear}
ATTENTION_TARGETS = {torch.ops.llmnpu.chunk_attention.default}


def shadow_delta(x: torch.Tensor, linear: str) -> torch.Tensor:
    """Graph marker for one linear's shadow outlier product ``(x - clip(x)) @ W^T[outlier channels]``.

    It carries no weights: a backend binds it to the linear's float rows when it lowers the shadow
    subgraph. Running it unbound is a bug, so it says so.
    """
    raise LlmNpuError(f"shadow path of {linear} was not bound by a backend")


def peak_delta(x: torch.Tensor, linear: str) -> torch.Tensor:
    """Graph marker for one linear's shadow product inside its NPU graph (placement piece ``peak``):
    ``(x - clip(x))[:, P] @ W^T[P]`` over a static set ``P`` of the input's peak channels, at 16-bit
    activations. The phone model prices it; the cpu-int8 engine binds it (``PeakProduct``)."""
    raise LlmNpuError(f"the in-graph peak product of {linear} was not bound by a backend")


def shadow_paths(nodes) -> list[str]:
    """The linears whose shadow product ``nodes`` hold (``shadow_delta`` markers), in order."""
    return [n.args[1] for n in nodes if n.op == "call_function" and n.target is shadow_delta]


def is_linear(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if node.target in _LINEAR_TARGETS:
        return True
    return "aten.linear.default" in str(node.target)  # edge dialect: exir_ops.edge.aten.linear.default


def weight_name_of(node: Node, param_of_placeholder: dict[str, str] | None = None) -> str | None:
    """FQN of a linear's weight: a ``get_attr`` target, or a lifted parameter placeholder."""
    w = node.args[1] if len(node.args) > 1 else node.kwargs.get("weight")
    if not isinstance(w, Node):
        return None
    if w.op == "get_attr":
        return str(w.target)
    if w.op == "placeholder" and param_of_placeholder:
        return param_of_placeholder.get(w.name)
    return None


def is_qdq(node: Node) -> bool:
    """A pt2e quantize/dequantize node (``quantized_decomposed`` ops, any dialect)."""
    return node.op == "call_function" and "quantized_decomposed" in str(node.target) and "quantize_per" in str(node.target)


def _module_of(node: Node) -> str | None:
    """The innermost nn.Linear a node was traced in (how a quantized graph names its linears: their
    weights are then dequantize nodes over folded constants)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return str(path) if cls.rsplit(".", 1)[-1] == "Linear" else None


def reads_a_norm(linear: Node) -> bool:
    """Whether ``linear`` reads a norm's output (through views and quantize/dequantize nodes): q/k/v
    and gate/up, whose inputs a norm's weights make peak on the same few channels token after token."""
    x = linear.meta.get("llmnpu_source", linear.args[0])
    while isinstance(x, Node) and (movable(x) or is_qdq(x)) and x.all_input_nodes:
        x = x.all_input_nodes[0]
    return isinstance(x, Node) and x.op == "call_function" and piece_of(x, ATTENTION_TARGETS) == "norms"


def in_graph_outputs(linears: dict[Node, str], placement: Placement) -> set[Node]:
    """The linears whose outputs stay inside their NPU graph: with piece ``peak``, the norm readers
    (their 8-bit outputs requantized to 16 bits in the graph, their products added there)."""
    return {n for n in linears if reads_a_norm(n)} if placement.on_npu("peak") else set()


def _in_shadow_branch(node: Node) -> bool:
    """A linear of a dense shadow branch (``lower/shadow_branches.py``): float work, never an NPU linear."""
    stack = node.meta.get("nn_module_stack") or {}
    return bool(stack) and str(list(stack.values())[-1][1]).endswith(SHADOW_BRANCH)


def linear_names(gm: fx.GraphModule, quantizable: Iterable[str], prefix: str = "",
                 param_of_placeholder: dict[str, str] | None = None) -> dict[Node, str]:
    """The graph's linear nodes that are quantizable, mapped to their module names (without ``prefix``)."""
    wanted = set(quantizable)
    found: dict[Node, str] = {}
    for node in gm.graph.nodes:
        if not is_linear(node) or _in_shadow_branch(node):
            continue
        w = weight_name_of(node, param_of_placeholder)
        weight = node.args[1] if len(node.args) > 1 else None
        if w is None and isinstance(weight, Node) and is_qdq(weight) and _module_of(node):
            w = _module_of(node) + ".weight"
        if w is None or not w.endswith(".weight"):
            continue
        name = w[: -len(".weight")]
        name = name[len(prefix):] if prefix and name.startswith(prefix) else name
        if name in wanted:
            found[node] = name
    return found


def processors(gm: fx.GraphModule, linears: dict[Node, str], placement: Placement) -> dict[Node, tuple[str, str]]:
    """``("npu" | "cpu", why)`` for every compute node of ``gm``: the linears on the NPU, the pieces
    ``placement`` names on the NPU, views and casts with their neighbours (on the NPU when they read
    NPU work and only NPU work reads them), everything else on the CPU, each with the reason."""
    proc: dict[Node, tuple[str, str]] = {}
    movable_nodes = []
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module"):
            continue
        if node in linears:
            proc[node] = ("npu", "a quantized linear")
        elif node.target is shadow_delta:
            proc[node] = ("cpu", "a shadow product: sparse float work over the outliers' weight rows")
        elif movable(node) or is_qdq(node):
            movable_nodes.append(node)
            proc[node] = ("cpu", "a view or cast that does not sit between NPU work only")
        elif node.op != "call_function":
            proc[node] = ("cpu", f"a {node.op} the partitioner does not look into")
        elif is_linear(node):
            proc[node] = ("cpu", "a linear left in float (not among the quantized ones)")
        else:
            piece = piece_of(node, ATTENTION_TARGETS)
            if piece is None:
                proc[node] = ("cpu", "outside the decoder blocks (embedding, rotary tables, masks, final norm, "
                                     "head): once per chunk")
            elif placement.on_npu(piece):
                proc[node] = ("npu", f"{piece}, on the NPU in placement {placement.name}")
            else:
                proc[node] = ("cpu", f"{piece}, not on the NPU in placement {placement.name}")
    # a chain of views from NPU work to NPU work stays on the NPU
    moving = set(movable_nodes)
    reads: set[Node] = set()
    for node in movable_nodes:
        if any((_on(proc, a) and a not in moving) or a in reads for a in node.all_input_nodes):
            reads.add(node)
    # With piece peak a graph hands a view's value to the CPU (a shadow product's input) and goes
    # on with it; otherwise a view any CPU work reads is made on the CPU.
    some = any if placement.on_npu("peak") else all
    feeds: set[Node] = set()
    for node in reversed(movable_nodes):
        if node.users and some((_on(proc, u) and u not in moving) or u in feeds for u in node.users):
            feeds.add(node)
    for node in reads & feeds:
        proc[node] = ("npu", "a view or cast between NPU work")
    return proc


def _on(proc: dict, node: Node) -> bool:
    return node in proc and proc[node][0] == "npu"


def npu_regions(gm: fx.GraphModule, linears: dict[Node, str], placement: "Placement | str" = PAPER) -> list[list[Node]]:
    """Maximal NPU regions in program order.

    A region is NPU work that can run as one graph: every path between two of its nodes stays on the
    NPU. Each NPU node gets a *stage*, the number of NPU -> CPU -> NPU hand-overs on the longest path
    that reaches it; a region is a connected group of NPU nodes of one stage (linears that read the
    same tensor count as connected: q/k/v share one quantized input, as do gate/up). A shadow product
    merged on the NPU thus ends one region and starts the next.

    A linear's output leaves its region too: NPU work that reads it (RoPE, a q/k norm, the gated
    activation, a merge) starts the next one. An integer NPU graph gives a linear's output at 8 bits,
    in channel groups of their own encodings (``lower/npu_subgraphs.output_groups``) that only the
    runner puts back together; so every program, and the engine it is checked against, cuts there.
    The exception is piece ``peak`` (``in_graph_outputs``): its linears' outputs are requantized to
    16 bits inside the graph, one encoding each, and the graph goes on."""
    placement = parse_placement(placement)
    proc = {n: p for n, (p, _) in processors(gm, linears, placement).items()}
    ends = set(linears) - in_graph_outputs(linears, placement)
    stage: dict[Node, int] = {}      # NPU: its stage; CPU: the latest stage it depends on (-1: none)
    for node in gm.graph.nodes:
        inputs = [stage[a] + (1 if proc.get(node) == "npu" and (proc[a] == "cpu" or a in ends) else 0)
                  for a in node.all_input_nodes if a in stage]
        if node in proc:
            stage[node] = max(inputs, default=0 if proc[node] == "npu" else -1)
    parent = {n: n for n in proc if proc[n] == "npu"}

    def find(n: Node) -> Node:
        while parent[n] is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    def union(a: Node, b: Node) -> None:
        if stage[a] == stage[b]:
            parent[find(a)] = find(b)

    sources: dict[Node, Node] = {}
    for node in parent:
        for a in node.all_input_nodes:
            if a in parent:
                union(node, a)
        if node in linears:
            src = node.meta.get("llmnpu_source", node.args[0])
            if src in sources:
                union(node, sources[src])
            sources.setdefault(src, node)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    groups: dict[Node, list[Node]] = {}
    for node in sorted(parent, key=order.__getitem__):
        groups.setdefault(find(node), []).append(node)
    # a region holds the weights (get_attr) only its own non-linear nodes read (a norm's); a linear's
    # weight is compiled into the backend's region from the model
    regions = []
    for members in groups.values():
        inside = set(members)
        weights = [a for n in members if n not in linears for a in n.all_input_nodes
                   if a.op == "get_attr" and all(u in inside for u in a.users)]
        regions.append(sorted(dict.fromkeys(members + weights), key=order.__getitem__))
    regions.sort(key=lambda r: (max(stage.get(n, 0) for n in r), min(order[n] for n in r)))
    return regions


# --------------------------------------------------------------------------- subgraphs
@dataclass
class Subgraph:
    index: int
    kind: str                    # "cpu" | "npu" | "shadow" (the float outlier path, on the CPU)
    layer: int | None            # decoder layer, or None for the model's prologue / head
    static: bool                 # True: shapes depend on the chunk length only (shared by all chunks)
    inputs: list[str]
    outputs: list[str]
    linears: list[str] = field(default_factory=list)   # npu: region's linears; shadow: shadowed ones
    nodes: list[Node] = field(default_factory=list, repr=False)

    @property
    def processor(self) -> str:
        return "npu" if self.kind == "npu" else "cpu"

    def flops(self, past: int) -> int:
        """Multiply-adds x 2 of the linears and attention in this subgraph for a chunk at past length ``past``."""
        return sum(node_flops(n, past) for n in self.nodes)

    def structure(self) -> tuple:
        """What it computes, without names: per node its op, its operands' shapes and its result's.
        Subgraphs of different layers with equal structures do the same work (the same linears'
        shapes on the same activations)."""
        return (self.kind, tuple((str(n.target), tuple(_val_shape(a) for a in n.args), _val_shape(n))
                                 for n in self.nodes if n.op == "call_function"))


def dim_size(v, past: int) -> int:
    if isinstance(v, torch.SymInt):
        expr = v.node.expr
        return int(expr.subs({s: past for s in expr.free_symbols}))
    return int(v)


def node_shape(node: Node, past: int) -> list[int]:
    return [dim_size(d, past) for d in node.meta["val"].shape]


def _val_shape(v):
    """The shape(s) of a node's value, the type of anything else (a constant operand)."""
    if not isinstance(v, Node):
        return type(v).__name__
    val = v.meta.get("val")
    vals = val if isinstance(val, (list, tuple)) else [val]
    return tuple(tuple(str(d) for d in x.shape) if isinstance(x, torch.Tensor) else type(x).__name__ for x in vals)


def node_flops(node: Node, past: int) -> int:
    if is_linear(node) and "val" in node.meta:
        out = node_shape(node, past)
        k = node_shape(node.args[0], past)[-1]
        return 2 * math.prod(out) * k
    if node.op == "call_function" and node.target in ATTENTION_TARGETS:
        q, k = node_shape(node.args[0], past), node_shape(node.args[1], past)
        return 2 * 2 * q[1] * q[2] * k[2] * q[3]       # QK^T and PV
    return 0


def _is_dynamic(node: Node) -> bool:
    vals = node.meta.get("val")
    vals = vals if isinstance(vals, (list, tuple)) else [vals]
    for v in vals:
        if isinstance(v, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in v.shape):
            return True
        if isinstance(v, torch.SymInt):
            return True
    return False


@dataclass
class Partition:
    """The ordered subgraphs of one chunk step, over ``graph_module`` (a rewritten copy of the input)."""
    graph_module: fx.GraphModule
    subgraphs: list[Subgraph]
    graph_inputs: list[str]
    graph_outputs: list[str]           # flattened in the graph's output order
    placement: Placement
    shadowed: list[str]
    why: dict[str, str] = field(default_factory=dict)   # a CPU node's name -> why it is not on the NPU

    def by_kind(self, kind: str) -> list[Subgraph]:
        return [s for s in self.subgraphs if s.kind == kind]

    def npu_flop_share(self, chunks: int, chunk_len: int) -> float:
        npu = total = 0
        for i in range(chunks):
            for s in self.subgraphs:
                f = s.flops(i * chunk_len)
                total += f
                npu += f if s.processor == "npu" else 0
        return npu / total if total else 0.0


def _insert_shadow(graph: fx.Graph, linears: dict[Node, str], shadowed: set[str], in_graph: set[Node]) -> list[Node]:
    """``y = linear(x)`` -> ``y' = y + shadow_delta(x)`` for shadowed linears (``peak_delta`` for
    those of ``in_graph``); returns the CPU products' marker nodes."""
    markers = []
    for node, name in list(linears.items()):
        if name not in shadowed:
            continue
        peak = node in in_graph
        with graph.inserting_after(node):
            delta = graph.call_function(peak_delta if peak else shadow_delta, (node.args[0], name))
        with graph.inserting_after(delta):
            total = graph.call_function(operator.add, (node, delta))
        node.replace_all_uses_with(total, delete_user_cb=lambda u, t=total: u is not t)
        delta.meta["val"] = node.meta.get("val")
        total.meta["val"] = node.meta.get("val")
        for n in (delta, total):
            n.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        if peak:
            delta.meta[PEAK] = total.meta[PEAK] = True
            continue
        total.meta[MERGE] = True
        markers.append(delta)
    return markers


def _drop_asserts(graph: fx.Graph) -> None:
    """Remove export's runtime checks (metadata asserts, the input-guard call): the runtime checks
    prompts itself, and a guard reading every input would tie the last subgraph to all of them."""
    for node in list(graph.nodes):
        if node.op in ("call_function", "call_module") and not node.users and (
                "_assert" in str(node.target) or "_guards" in str(node.target)):
            graph.erase_node(node)
    graph.eliminate_dead_code()


def _canonical_sizes(graph: fx.Graph) -> None:
    """Read every symbolic input size from the first input that has it.

    transformers computes the mask length from one layer's cache (here: the last layer's V). Left
    alone, that would make layer 0's attention of chunk i wait for the last layer of chunk i-1, a
    false cross-layer dependency; all past K/V share one symbolic length, so any of them will do.
    """
    first: dict[tuple, Node] = {}
    for node in graph.nodes:
        if node.op != "placeholder" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        for dim, size in enumerate(node.meta["val"].shape):
            if isinstance(size, torch.SymInt):
                first.setdefault((str(size.node.expr), dim), node)
    for node in graph.nodes:
        if node.op == "call_function" and node.target == torch.ops.aten.sym_size.int:
            src, dim = node.args
            val = src.meta.get("val") if isinstance(src, Node) else None
            if src.op == "placeholder" and isinstance(val, torch.Tensor) and isinstance(val.shape[dim], torch.SymInt):
                node.args = (first[(str(val.shape[dim].node.expr), dim)], dim)


def partition_graph(gm: fx.GraphModule, quantizable: Iterable[str], *, shadowed: Iterable[str] = (),
                    placement: "Placement | str" = PAPER, prefix: str = "",
                    param_of_placeholder: dict[str, str] | None = None) -> Partition:
    """Cut ``gm`` into ordered NPU / CPU / shadow subgraphs (``gm`` itself is left untouched).
    ``placement``: a ``Placement`` or its name (``placement.parse_placement``)."""
    placement = parse_placement(placement)
    new = _copy_graph(gm)
    linears = linear_names(new, quantizable, prefix, param_of_placeholder)
    shadowed = set(shadowed) & set(linears.values())
    markers = _insert_shadow(new.graph, linears, shadowed, in_graph_outputs(linears, placement))
    slot = _place(new.graph, npu_regions(new, linears, placement), linears, [] if placement.inline else markers)
    if placement.inline:     # each add of a product runs in the product's task: added in place (runtime/fuse.py)
        for m in markers:
            for u in m.users:
                u.meta[MERGE] = INLINE
    order = {n: i for i, n in enumerate(new.graph.nodes)}
    by_slot: dict[int, list[Node]] = {}
    for node in sorted(slot, key=order.__getitem__):
        by_slot.setdefault(slot[node], []).append(node)

    output = next(n for n in new.graph.nodes if n.op == "output")
    flat_out = [n for n in torch.utils._pytree.tree_leaves(output.args[0]) if isinstance(n, Node)]
    groups = _split_for_kv(by_slot, _ancestors(flat_out[1:]))
    produced_in = {n for _, nodes in groups for n in nodes}
    subgraphs: list[Subgraph] = []
    for s, nodes in groups:
        subgraphs.append(_subgraph(len(subgraphs), s, nodes, linears, markers, produced_in))
    graph_inputs = [n.name for n in new.graph.nodes if n.op == "placeholder"]
    on_cpu = {n for s in subgraphs if s.processor == "cpu" for n in s.nodes}
    why = {n.name: reason for n, (_, reason) in processors(new, linears, placement).items() if n in on_cpu}
    return Partition(new, subgraphs, graph_inputs, [n.name for n in flat_out], placement, sorted(shadowed), why)


def _copy_graph(gm: fx.GraphModule) -> fx.GraphModule:
    """A copy of ``gm`` with its nodes' metadata, without asserts, with canonical sizes."""
    graph = fx.Graph()
    out_map: dict[Node, Node] = {}
    graph.graph_copy(gm.graph, out_map)
    # graph_copy drops the output node's value; copy it over
    old_out = next(n for n in gm.graph.nodes if n.op == "output")
    graph.output(fx.node.map_arg(old_out.args[0], lambda n: out_map[n]))
    new = fx.GraphModule(gm, graph)
    for old, nn_ in out_map.items():
        nn_.meta = dict(old.meta)
    _drop_asserts(new.graph)
    _canonical_sizes(new.graph)
    return new


# Slots of region r: SLOTS * r + one of these; SLOTS * R is the tail (the CPU work after the last region)
SLOTS = 4
CPU_BEFORE, BESIDE, REGION, AFTER = range(SLOTS)


def _place(graph: fx.Graph, regions: list, linears: dict, beside: list[Node]) -> dict[Node, int]:
    """Each compute node's slot (``SLOTS``): the CPU work before region r, the shadow products of
    ``beside`` that run beside it, the region, the products of inputs it made. A CPU node goes to
    the latest CPU slot before its first user (an inline shadow product: the task that merges it)."""
    slot: dict[Node, int] = {}
    made_in = {n: r for r, region in enumerate(regions) for n in region}
    for r, region in enumerate(regions):
        entries = {n.args[0] for n in region if n in linears}
        for n in region:
            slot[n] = SLOTS * r + REGION
        for m in beside:
            # The shadow product reads the region's float input: it can run beside the region.
            # When that input is made inside a region (norms on the NPU), the product runs as a
            # task of its own right after that region: a task whose output a runner can add cold
            # rows to, as beside one.
            if m.args[0] in made_in:
                slot[m] = SLOTS * made_in[m.args[0]] + AFTER
            elif m.args[0] in entries:
                slot[m] = SLOTS * r + BESIDE
    tail = SLOTS * len(regions)
    for node in reversed(list(graph.nodes)):
        if node.op in ("placeholder", "output", "get_attr") or node in slot:
            continue
        latest = tail
        for u in node.users:
            if u.op == "output":
                continue
            s = slot.get(u)
            if s is None:      # a get_attr-free user not placed yet cannot exist in reverse order
                raise LlmNpuError(f"partitioner: user {u.name} of {node.name} has no subgraph")
            # a CPU node joins the task of a product made after a region; else the CPU slot before
            latest = min(latest, s if s % SLOTS in (CPU_BEFORE, AFTER) else s - s % SLOTS)
        slot[node] = latest
    # Check the placement is causal: every input is produced in an earlier-or-same CPU slot.
    for node, s in slot.items():
        for a in node.all_input_nodes:
            sa = slot.get(a)
            if sa is not None and sa > s:
                raise LlmNpuError(f"partitioner: {node.name} would run before its input {a.name}")
    return slot


def _subgraph(index: int, s: int, nodes: list[Node], linears: dict, markers: list[Node],
              produced_in: set[Node]) -> Subgraph:
    """The subgraph of slot ``s`` made of ``nodes``: its kind, inputs and outputs by name."""
    members = set(nodes)
    kind = {REGION: "npu", BESIDE: "shadow", AFTER: "shadow"}.get(s % SLOTS, "cpu")
    # An NPU region's weights are compiled into it: lifted weight placeholders are not runtime inputs.
    weights = {a for n in nodes if kind == "npu" and n in linears for a in n.args[1:3] if isinstance(a, Node)}
    inputs: list[str] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in members and a.op != "get_attr" and a not in weights and a.name not in inputs:
                inputs.append(a.name)
    outputs = [n.name for n in nodes
               if any(u.op == "output" or (u not in members and u in produced_in) for u in n.users)]
    layers = [lyr for lyr in map(layer_of, nodes) if lyr is not None]
    names = ([linears[n] for n in nodes if n in linears] if kind == "npu"
             else [n.args[1] for n in nodes if n in markers] if kind == "shadow" else [])
    # dynamic: a value of it, or one it reads, grows with the past (attention)
    dynamic = any(_is_dynamic(n) or any(_is_dynamic(a) for a in n.all_input_nodes) for n in nodes)
    return Subgraph(index, kind, min(layers) if layers else None, not dynamic, inputs, outputs, names, nodes)


def _ancestors(nodes: list[Node]) -> set[Node]:
    """``nodes`` and every node they are computed from."""
    seen, stack = set(), list(nodes)
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(n.all_input_nodes)
    return seen


def _split_for_kv(by_slot: dict[int, list[Node]], kv: set[Node]) -> list[tuple[int, list[Node]]]:
    """The slots in order, a CPU slot cut in two where only part of it makes the K/V: that part
    first, the rest after. A chunk other than the last needs only its K/V (the logits are the last
    chunk's), so it runs the first part alone. In a decoder this cuts the last layer's attention
    step: every chunk makes its K/V there, only the last one needs the attention product (1-2 ms
    a chunk at 1,024 tokens on the embedded model, at the very end of the prefill). ``kv``: the
    nodes the graph's K/V outputs (every output but the logits, the first) are computed from."""
    groups = []
    for s in sorted(by_slot):
        nodes = by_slot[s]
        first = [n for n in nodes if n in kv]
        if s % SLOTS == CPU_BEFORE and first and len(first) < len(nodes):
            groups += [(s, first), (s, [n for n in nodes if n not in kv])]
        else:
            groups.append((s, nodes))
    return groups


def subgraph_module(partition: Partition, sub: Subgraph) -> fx.GraphModule:
    """A standalone GraphModule for ``sub``: placeholders named after its inputs, a tuple of its outputs."""
    graph = fx.Graph()
    env: dict[Node, Node] = {}
    gm = partition.graph_module
    by_name = {n.name: n for n in gm.graph.nodes}
    for name in sub.inputs:
        ph = graph.placeholder(name)
        ph.meta = dict(by_name[name].meta)
        env[by_name[name]] = ph

    def lookup(a: Node) -> Node:
        if a not in env:
            if a.op != "get_attr":
                raise LlmNpuError(f"partitioner: {a.name} is not an input of subgraph {sub.index}")
            env[a] = graph.get_attr(a.target)
        return env[a]

    for node in sub.nodes:
        env[node] = graph.node_copy(node, lookup)
    graph.output(tuple(env[by_name[o]] for o in sub.outputs))
    return fx.GraphModule(gm, graph)

