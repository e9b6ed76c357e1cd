"""How a program stores the embedding table and the LM head, and the dynamic INT8 linears they share.

With an INT8 decode (the default) the program keeps no float32 copy of the table:

- the lookups (the prefill's first subgraph and the decode step) gather rows of a **float16** table
  and widen them to float32: float16 keeps 11 significant bits, far below the INT8 regions' steps
  (on the embedded model the float model's next-token argmax is unchanged at every position of
  the evaluation text, ``benchmarks/storage_accuracy.py``);
- the LM head, in the prefill as in the decode, is XNNPACK's **dynamic INT8** linear: weights INT8
  per output channel, activations quantized per token at run time. The two methods quantize the
  same float weight the same way, so XNNPACK's named data (keyed by the bytes' SHA-256) holds it once.
  A float head would read a float32 table (resident whole at every prefill: 108 MiB on the embedded
  model); the prefill only computes the first answer token with it, the decode every later one.

``--decode fp32`` is the float reference and keeps the float32 table and head.
"""
from __future__ import annotations

import functools

import torch
from torch import Tensor, fx

from ..partitioner.regions import is_linear
from .xnnpack_forms import int8_weights_as_rows

TABLE_DTYPE = torch.float16


def half_table_lookups(gm: fx.GraphModule) -> int:
    """Make every ``aten.embedding`` of ``gm`` gather from a float16 copy of its table, widened to
    float32; other readers of the table (a tied head) keep the original. Returns how many lookups
    changed."""
    changed, tables = 0, set()
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not torch.ops.aten.embedding.default:
            continue
        weight = node.args[0]
        if weight.op != "get_attr":
            continue
        table: Tensor = functools.reduce(getattr, weight.target.split("."), gm)
        tables.add(weight.target)
        attr = weight.target.replace(".", "_") + "_fp16"
        if not hasattr(gm, attr):
            gm.register_buffer(attr, table.detach().to(TABLE_DTYPE).contiguous())
        with gm.graph.inserting_before(node):
            half = gm.graph.get_attr(attr)
        node.replace_input_with(weight, half)
        with gm.graph.inserting_after(node):
            wide = gm.graph.call_function(torch.ops.aten.to.dtype, (node, torch.float32))
        node.replace_all_uses_with(wide, delete_user_cb=lambda user: user is not wide)
        changed += 1
    if changed:
        gm.graph.eliminate_dead_code()
        # a table no other node reads must leave the module, or export would keep it as a constant
        read = {n.target for n in gm.graph.nodes if n.op == "get_attr"}
        for target in tables - read:
            owner, _, name = target.rpartition(".")
            delattr(gm.get_submodule(owner), name)
        gm.recompile()
    return changed


def quantize_dynamic(gm: torch.nn.Module, examples: list[tuple], float_weights=()):
    """An exported program of ``gm`` (an exported program's ``module()``) with its linears quantized
    as XNNPACK's dynamic INT8: weights per output channel, activations per token at run time; but
    not the linears whose weight is one of ``gm``'s attributes ``float_weights``. ``examples``: inputs
    to run the prepared module on (dynamic scales need no statistics; one run suffices); the first
    is the export's example. Linears flagged ``xnnpack_forms.mark_as_rows`` store their weights as W^T rows."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    class Quantizer(XNNPACKQuantizer):
        # XNNPACKQuantizer cannot leave a named module unquantized (set_module_name refuses None)
        def annotate(self, gm):
            gm = super().annotate(gm)
            for node in gm.graph.nodes:
                weight = node.args[1] if is_linear(node) and len(node.args) > 1 else None
                if isinstance(weight, fx.Node) and weight.op == "get_attr" and weight.target in float_weights:
                    node.meta.pop("quantization_annotation", None)
            return gm

    quantizer = Quantizer().set_global(get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True))
    prepared = prepare_pt2e(gm, quantizer)
    for args in examples:
        prepared(*args)
    converted = convert_pt2e(prepared, fold_quantize=False)
    fold_weight_quantization(converted)
    int8_weights_as_rows(converted)
    return torch.export.export(converted, examples[0], strict=False)


def fold_weight_quantization(gm: fx.GraphModule) -> int:
    """Replace each quantize op whose inputs are all constants (a weight's quantization) by its INT8
    result, one weight at a time; the float weights it read are dropped if nothing else reads them.
    What ``convert_pt2e``'s own folding gives, but its folder evaluates every constant expression of
    the graph at once and holds them all until it is done (float copies of the weights among them):
    2.6 GiB above the model while folding a 0.5B decode step, 6.5 GiB for a 1.8B one, where this
    holds one weight's temporaries. Returns the number of quantize ops folded."""
    from torchao.quantization.pt2e.constant_fold import replace_node_with_constant
    from torchao.quantization.pt2e.quantize_pt2e import _QUANT_OPS

    class NotConstant(Exception):
        pass

    def value_of(node):
        if node.op == "get_attr":
            return functools.reduce(getattr, node.target.split("."), gm)
        if node.op != "call_function":
            raise NotConstant
        args, kwargs = fx.node.map_arg((node.args, node.kwargs), value_of)
        plain = [list(a) if isinstance(a, (list, tuple)) else a for a in args]   # fx's immutable lists
        with torch.no_grad():
            return node.target(*plain, **kwargs)

    def constant(node):
        """``node``'s value if it is a constant expression, else None."""
        try:
            return value_of(node)
        except NotConstant:
            return None

    folded = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _QUANT_OPS:
            folded_value = constant(node)
            if folded_value is not None:
                replace_node_with_constant(gm, node, folded_value)
                folded += 1
    for node in list(gm.graph.find_nodes(op="get_attr")):
        if not node.users:
            if hasattr(gm, node.target):
                delattr(gm, node.target)
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()
    return folded
