"""Placement: which of a decoder block's optional pieces run on the NPU beside its linears.

The quantizable linears always go to the NPU and the shadow outlier products stay on the CPU (sparse
float work: a few rows of W per outlier element), but for piece ``peak`` below. Between those two,
each *piece* of a block can run on either side:

- ``attention``: the chunk's attention over its K/V (Q K^T, softmax, P V) and the write of the
  chunk's K/V beside the past;
- ``norms``: the blocks' RMSNorms (q/k norms included);
- ``rope``: the rotary embedding of q and k;
- ``residual``: the residual adds;
- ``act``: the gated activation between gate/up and down;
- ``merge``: the add of a shadow product onto its linear's output;
- ``peak``: the shadow products of the linears that read a norm's output (q/k/v, gate/up) inside
  their NPU graphs, over a static set of the input's peak channels at 16-bit activations, those
  linears' outputs kept in the graph at 16 bits. A norm's weights make the same few channels peak
  on every token, so a static set holds their outliers; the inputs of o_proj and down_proj spread
  theirs, and those products stay on the CPU (docs/results.md, "Shadow products inside the NPU
  graphs"). Priced by ``llmnpu simulate``, run by the cpu-int8 engine and written by its program
  with float outputs; a QNN program writes them in its norm graphs beside attention on the CPU
  (``norms+peak``: ``lower/norm_region.py``), not yet with attention in the same graph.

The paper keeps them all on the CPU (``paper``); ``fused`` moves every piece. Which placement is fastest depends on the target:
a phone's NPU runs them far faster than its CPU, but each shadow product merged on the NPU ends one
NPU graph and starts another. ``backends`` declare the pieces they can run; ``llmnpu simulate``
chooses among the placements they allow by predicted prefill.

Where the CPU runs a shadow product is part of a placement too. By default it runs *beside* its
linear's NPU region, as its own task reading the region's input: the CPU computes it while the NPU
runs the linear (the paper's overlap), and a later task adds it. ``+inline`` runs it in the CPU task
that reads the linear's output instead, added into that output in place: one task and one pass
fewer, no buffer for the product, and no overlap. On a host whose two workers share the same cores
the overlap buys nothing and the saved work counts (``paper+inline``); a placement that merges on
the NPU has no CPU merge to inline.

Work outside the decoder blocks (the embedding, the rotary tables, the masks, the final norm and
the head) stays on the CPU: it runs once per chunk and feeds or follows every block.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Node

from ..errors import LlmNpuError

PIECES = ("attention", "norms", "rope", "residual", "act", "merge", "peak")
INLINE = "inline"   # the shadow products run inside the task that reads their linears' outputs
PAPER = "paper"
AUTO = "auto"       # where a target chooses: the fastest placement its backend allows, by its own cost
PRESETS = {
    "paper": (),                                   # the paper's split: linears only
    "norms": ("norms",),                           # norms folded into the regions they feed
    "attention-half": ("attention", "rope", "norms"),  # the attention half of each block on the NPU
    "block": PIECES[:-1],                          # everything but the shadow products
    "fused": PIECES,                               # and the norm readers' products over peak channels
}
MERGE = "llmnpu_merge"      # node.meta key set on the add of a shadow product (regions._insert_shadow)
PEAK = "llmnpu_peak"        # node.meta key set on an in-graph peak product and its add (piece ``peak``)

# Ops that compute nothing: they follow their neighbours onto either processor.
_MOVABLE = {"view", "_unsafe_view", "reshape", "transpose", "permute", "unsqueeze", "squeeze", "expand",
            "slice", "select", "t", "alias", "detach", "detach_", "clone", "contiguous", "to", "_to_copy",
            "getitem", "lift_fresh_copy", "_assert_tensor_metadata"}


@dataclass(frozen=True)
class Placement:
    pieces: frozenset
    inline: bool = False    # shadow products inline in their merge's CPU task, not beside their region

    def __post_init__(self):
        unknown = set(self.pieces) - set(PIECES)
        if unknown:
            raise LlmNpuError(f"unknown placement piece(s) {', '.join(sorted(unknown))}: use {', '.join(PIECES)}")
        if self.inline and "merge" in self.pieces:
            raise LlmNpuError(f"placement {self._base_name()}+{INLINE}: its shadow products merge on the NPU, so "
                              f"no CPU task merges them to run them in; drop '+{INLINE}' or the 'merge' piece")

    def _base_name(self) -> str:
        for name, pieces in PRESETS.items():
            if set(pieces) == self.pieces:
                return name
        return "+".join(p for p in PIECES if p in self.pieces)

    @property
    def name(self) -> str:
        return self._base_name() + (f"+{INLINE}" if self.inline else "")

    @property
    def base(self) -> "Placement":
        """The same pieces with each shadow product beside its region (``+inline`` dropped)."""
        return Placement(self.pieces)

    def __str__(self) -> str:
        return self.name

    def on_npu(self, piece: str) -> bool:
        return piece in self.pieces


def parse_placement(text: "str | Placement") -> Placement:
    """A preset name (``paper``, ``norms``, ``attention-half``, ``block``) or pieces joined by ``+``
    (``attention+rope+norms``), either followed by ``+inline`` (``paper+inline``)."""
    if isinstance(text, Placement):
        return text
    tokens = [p for p in str(text).split("+") if p]
    inline = INLINE in tokens
    tokens = [p for p in tokens if p != INLINE]
    if len(tokens) == 1 and tokens[0] in PRESETS:
        return Placement(frozenset(PRESETS[tokens[0]]), inline)
    if not tokens or any(p not in PIECES for p in tokens):
        raise LlmNpuError(f"unknown placement '{text}': use one of {', '.join(PRESETS)}, or pieces joined by '+' "
                          f"from {', '.join(PIECES)}; either may end with '+{INLINE}'")
    return Placement(frozenset(tokens), inline)


def with_inline(placements: list[str]) -> list[str]:
    """``placements`` (names), each followed by its ``+inline`` form where it has one."""
    out = []
    for name in placements:
        out.append(name)
        p = parse_placement(name)
        if not p.inline and not p.on_npu("merge"):
            out.append(Placement(p.pieces, True).name)
    return out


def op_name(node: Node) -> str:
    t = node.target
    if t is operator.add or t is operator.getitem:
        return t.__name__
    return getattr(t, "__name__", str(t)).split(".")[0]


def movable(node: Node) -> bool:
    """A view, cast or copy: no work of its own, it goes where its neighbours are."""
    return node.op in ("call_function", "call_method") and (op_name(node) in _MOVABLE or _copies_one(node))


def _copies_one(node: Node) -> bool:
    """A concatenation of one tensor with empty ones (a cache filled from the past it is given)."""
    if op_name(node) != "cat" or not node.args or not isinstance(node.args[0], (list, tuple)):
        return False
    sizes = [a.meta.get("val") for a in node.args[0] if isinstance(a, Node)]
    return sum(not (isinstance(v, torch.Tensor) and v.numel() == 0) for v in sizes) == 1


def innermost_module(node: Node) -> tuple[str, str]:
    """The path and class name of the innermost module ``node`` was traced in ("" "" outside any)."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return "", ""
    path, cls = list(stack.values())[-1]
    cls = cls if isinstance(cls, str) else getattr(cls, "__name__", str(cls))
    return str(path), cls.rsplit(".", 1)[-1]


def layer_of(node: Node) -> int | None:
    """The decoder block ``node`` was traced in (``...layers.<i>...``), or None outside the blocks."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        parts = str(path).replace("_", ".").split(".")
        for a, b in zip(parts, parts[1:]):
            if a == "layers" and b.isdigit():
                return int(b)
    return None


def writes_kv(node: Node) -> bool:
    """The chunk's K/V written beside the past: a concatenation whose length is the past's (symbolic)."""
    val = node.meta.get("val")
    return (op_name(node) == "cat" and isinstance(val, torch.Tensor)
            and any(isinstance(d, torch.SymInt) for d in val.shape))


def piece_of(node: Node, attention_targets) -> str | None:
    """The piece a compute node belongs to, or None for work outside the pieces (prologue, head)."""
    if node.meta.get(PEAK):
        return "peak"
    if node.meta.get(MERGE):
        return "merge"
    if node.target in attention_targets or writes_kv(node):
        return "attention"      # with the K/V it reads and writes
    if layer_of(node) is None:
        return None
    _, cls = innermost_module(node)
    if "Norm" in cls:
        return "norms"
    if cls.endswith("Attention"):
        return "rope"           # the attention module's own float work besides attention
    if cls.endswith(("MLP", "Activation")) or "GELU" in cls or "SiLU" in cls:
        return "act"
    if cls.endswith("DecoderLayer"):
        return "residual"
    return None
