"""The program's decode step: one token at any position up to the context, on the CPU.

Following the paper, decode runs on the CPU side: one ``decode`` method of the ``.pte``, lowered to
ExecuTorch's XNNPACK delegate, with INT8 weights (per output channel) and activations quantized
per token at run time (``int8``, the usual on-device CPU decode), or in float (``fp32``, the
reference). The families' own ``transformers`` modules run unchanged; the attention is ours.

How the K/V are carried: a **static max-context cache that the method only reads**, with the new
token's K/V returned and written in place by the runner (ExecuTorch's static llama does the same).
Per layer the runner holds K as ``[1, KVH, d, context]`` (transposed, so ``q @ K`` needs no copy)
and V as ``[1, KVH, context, d]``; they are method inputs outside ExecuTorch's memory plan, so the
runtime reads the runner's memory in place. The prefill's K/V are written into them once.

What a step copies (SmolLM2-135M, context 1,024, fp32 K/V; ``benchmarks/bench_decode_kv.py``
measures the alternatives): this layout moves the new rows only, 30 x 2 x 3 x 64 x 4 B = 46 KB per
step. Carrying the K/V as inputs and outputs of a symbolic length P (the prefill's own layout) makes
the method concatenate the past with the new row and hand the whole cache back: 2 copies of
up to 47 MB per step, and a third if the runtime copies the inputs into its planned memory (the
default for method inputs). The price of the static cache is attention over all ``context`` slots,
the unwritten ones masked: a step at position p reads the whole cache rather than its first p rows.
Measured (fp32 step at position 512 of 1,024, XNNPACK, one thread, medians of 9): this layout 19.4 ms;
the same with memory-planned inputs 23.9 ms (1.23x); symbolic length in and out 49.1 ms (2.53x).
"""
from __future__ import annotations

import functools
import warnings

import torch
from torch import Tensor, fx, nn
from transformers import AttentionInterface
from transformers.cache_utils import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from ..chunk_step import attention_implementation
from ..errors import LlmNpuError
from ..families import family_of
from ..format.kv import empty_cache
from ..partitioner.regions import linear_names
from .embedding_head import half_table_lookups, quantize_dynamic
from .xnnpack_forms import for_xnnpack, mark_as_rows

MODES = ("int8", "fp32")
ATTN_IMPLEMENTATION = "llmnpu_decode"

_cache: dict = {}     # the step's cache inputs, read by the attention function while tracing


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None,
                      sliding_window=None, **_):
    """One query token against the cached positions < pos and itself. query [1, H, 1, d]; key/value:
    the new token's [1, KVH, 1, d]. Returns [1, 1, H, d], as transformers' attention does."""
    k_cache, v_cache = _cache["k"][module.layer_idx], _cache["v"][module.layer_idx]   # [1,KVH,d,T], [1,KVH,T,d]
    pos = _cache["pos"]
    _, heads, _, d = query.shape
    kvh, context = k_cache.shape[1], k_cache.shape[3]
    g = heads // kvh
    scaling = d ** -0.5 if scaling is None else scaling
    q = query.reshape(kvh, g, d)
    past = torch.bmm(q, k_cache.reshape(kvh, d, context)) * scaling         # [KVH, g, T]
    new = torch.bmm(q, key.reshape(kvh, d, 1)) * scaling                    # [KVH, g, 1]
    if softcap:
        past, new = torch.tanh(past / softcap) * softcap, torch.tanh(new / softcap) * softcap
    past = past + _unwritten_bias(context, pos, sliding_window)
    probs = torch.softmax(torch.cat([past, new], dim=-1), dim=-1)
    out = torch.bmm(probs[..., :context], v_cache.reshape(kvh, context, d)) + probs[..., context:] * value.reshape(kvh, 1, d)
    return out.reshape(1, 1, heads, d), None


def _unwritten_bias(context: int, pos: Tensor, sliding_window) -> Tensor:
    """0 on the slots the token sees, -inf on the others: made once per step and window, and added in
    every layer. An add stays inside XNNPACK's partition, where a per-layer comparison and
    ``masked_fill`` (portable ops) would cut the step into a partition per layer or more."""
    key = ("bias", sliding_window)
    if key not in _cache:
        slots = torch.arange(context)
        visible = slots < pos
        if sliding_window:
            visible = visible & (slots > pos - sliding_window)
        _cache[key] = torch.where(visible, 0.0, float("-inf"))
    return _cache[key]


def _no_mask(*args, **kwargs):
    return None      # the attention above masks by position itself


AttentionInterface.register(ATTN_IMPLEMENTATION, _decode_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_IMPLEMENTATION, _no_mask)


class DecodeStep(nn.Module):
    """forward(input_ids [1, 1], cache_position [1], k_cache, v_cache) -> (logits [1, V], k_new, v_new):
    k_cache/v_cache one [1, KVH, d, T] / [1, KVH, T, d] per layer (slots >= position unread);
    k_new/v_new one [1, KVH, 1, d] per layer, to be written at slot ``position``."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, cache_position: Tensor, k_cache: list[Tensor], v_cache: list[Tensor]):
        _cache.update(k=k_cache, v=v_cache, pos=cache_position)
        try:
            cache = DynamicCache()
            out = self.model(input_ids=input_ids, cache_position=cache_position, position_ids=cache_position[None],
                             past_key_values=cache, use_cache=True, logits_to_keep=1)
        finally:
            _cache.clear()
        return out.logits.reshape(1, -1), [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def example_inputs(kv, context: int, position: int = 3) -> tuple:
    return (torch.zeros(1, 1, dtype=torch.long), torch.tensor([position]), *empty_cache(kv, context))


@torch.no_grad()
def export_decode(model: nn.Module, kv, context: int, mode: str = "int8", calib_ids: Tensor | None = None,
                  hot_inputs: dict[str, list[int]] | None = None, padded: list[str] = (), as_rows: list[str] = ()):
    """The decode step as an edge program lowered to XNNPACK (``mode``: ``int8`` dynamic-activation
    INT8 linears, or ``fp32``). ``calib_ids``: a few tokens that drive the INT8 flow's preparation
    (dynamic activation scales need no statistics; the weights' scales come from the weights).
    ``hot_inputs``: per linear (model names), input channels that go through float rows in ``int8``
    mode (``quantize/decode_outliers.hot_inputs``: the program's outlier policy; ``split_hot_inputs``).
    In ``int8`` mode the embedding lookup reads a float16 table and the head is INT8 (``embedding_head.py``).
    ``padded``: linears (model names) whose INT8 weights get the zero columns of float-output NPU
    methods (``pad_linears``), so that both methods' weights are the same bytes."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import (
        XnnpackDynamicallyQuantizedPartitioner,
        XnnpackPartitioner,
    )
    from executorch.exir import to_edge_transform_and_lower

    if mode not in MODES:
        raise LlmNpuError(f"unknown decode mode '{mode}': use one of {', '.join(MODES)}")
    step = DecodeStep(model).eval()
    example = example_inputs(kv, context)
    with attention_implementation(model, ATTN_IMPLEMENTATION), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ep = torch.export.export(step, example, strict=False)
        if mode == "int8":
            gm = ep.module()
            rows = linear_names(gm, list(as_rows), "model.")     # before the rewrites below rename weights
            if missing := sorted(set(as_rows) - set(rows.values())):
                raise LlmNpuError(f"decode: linears {missing[:3]} to store as rows are not in the step")
            mark_as_rows(rows)
            half_table_lookups(gm)          # the table's only float copy is float16 (``embedding_head.py``)
            float_rows = split_hot_inputs(gm, hot_inputs or {})
            pad_linears(gm, list(padded))
            ids = calib_ids.reshape(-1)[:4] if calib_ids is not None else torch.zeros(1, dtype=torch.long)
            feeds = [(torch.tensor([[t]]), torch.tensor([i]), *example[2:]) for i, t in enumerate(ids.tolist())]
            ep = quantize_dynamic(gm, [example, *feeds], float_weights=float_rows)
    for_xnnpack(ep.graph_module)
    partitioners = [XnnpackPartitioner()]
    if mode == "int8" and family_of(model.config).qk_norm:
        # XNNPACK's one partition of the whole step closes a dependency cycle around the q/k norms that
        # sit between dynamically quantized projections and RoPE: its quantized linears are taken first
        partitioners.insert(0, XnnpackDynamicallyQuantizedPartitioner())
    return to_edge_transform_and_lower(ep, partitioner=partitioners)


HOT_PREFIX = "llmnpu_hot_"
PAD_PREFIX = "llmnpu_padded_"


def pad_linears(gm: fx.GraphModule, names: list[str], prefix: str = "model.") -> int:
    """Rewrite each linear named in ``names`` as ``linear(pad(x, 0, 0), [W 0 0])``: the float-output NPU
    methods' form of its weight (``npu_subgraphs.FloatOutputRegion``). Zero columns change neither
    the product nor a token's dynamic scale (its range always holds 0). Returns how many changed."""
    from .npu_subgraphs import SENTINELS, pad_columns

    found = linear_names(gm, names, prefix)
    if missing := sorted(set(names) - set(found.values())):
        raise LlmNpuError(f"decode: linears {missing[:3]} to pad are not in the step")
    graph, widened = gm.graph, {}
    for node, name in found.items():
        x, weight = node.args[0], node.args[1]
        w = functools.reduce(getattr, weight.target.split("."), gm)
        attr = PAD_PREFIX + name.replace(".", "_")
        gm.register_buffer(f"{attr}_weight", pad_columns(w).contiguous())
        if x not in widened:           # one pad per input (q, k and v share theirs)
            with graph.inserting_after(x):
                widened[x] = graph.call_function(torch.ops.aten.constant_pad_nd.default, (x, [0, SENTINELS], 0.0))
        wide = widened[x]
        with graph.inserting_before(node):
            padded_weight = graph.get_attr(f"{attr}_weight")
        node.replace_input_with(x, wide)
        node.replace_input_with(weight, padded_weight)
        if not weight.users:           # an attribute nothing reads would stay in the program as a constant
            owner, _, leaf = weight.target.rpartition(".")
            delattr(gm.get_submodule(owner), leaf)
            graph.erase_node(weight)
    graph.eliminate_dead_code()
    gm.recompile()
    return len(found)


def split_hot_inputs(gm: fx.GraphModule, hot: dict[str, list[int]], prefix: str = "model.") -> set[str]:
    """Rewrite each linear named in ``hot`` as ``linear(x * cold, W) + linear(linear(x, S), W[:, hot])``:
    the hot input channels zeroed in the part the dynamic INT8 GEMM quantizes (so the token's scale is
    set by ordinary values) and added back through float rows. ``S`` selects the hot channels as a
    tiny float product (a gather would be a portable op and split XNNPACK's partition of the step).
    Returns the get_attr targets of the float weights, which must stay float."""
    found = linear_names(gm, list(hot), prefix)
    if missing := sorted(set(hot) - set(found.values())):
        raise LlmNpuError(f"decode: linears {missing[:3]} to split are not in the step")
    keep = set()
    for node, name in found.items():
        x, weight = node.args[0], node.args[1]
        w = functools.reduce(getattr, weight.target.split("."), gm).detach().float()
        channels = torch.tensor(hot[name], dtype=torch.int64)
        cold = torch.ones(w.shape[1])
        cold[channels] = 0.0
        select = torch.zeros(channels.numel(), w.shape[1])
        select[torch.arange(channels.numel()), channels] = 1.0
        attr = HOT_PREFIX + name.replace(".", "_")
        for suffix, value in (("cold", cold), ("select", select), ("rows", w[:, channels].contiguous())):
            gm.register_buffer(f"{attr}_{suffix}", value)
        graph = gm.graph
        with graph.inserting_before(node):
            x_cold = graph.call_function(torch.ops.aten.mul.Tensor, (x, graph.get_attr(f"{attr}_cold")))
            x_hot = graph.call_function(torch.ops.aten.linear.default, (x, graph.get_attr(f"{attr}_select")))
            y_hot = graph.call_function(torch.ops.aten.linear.default, (x_hot, graph.get_attr(f"{attr}_rows")))
        node.replace_input_with(x, x_cold)
        with graph.inserting_after(node):
            y = graph.call_function(torch.ops.aten.add.Tensor, (node, y_hot))
        node.replace_all_uses_with(y, delete_user_cb=lambda user: user is not y)
        keep.update({f"{attr}_select", f"{attr}_rows"})
    gm.recompile()
    return keep
