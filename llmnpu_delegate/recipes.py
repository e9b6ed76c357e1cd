"""ExecuTorch's own Qualcomm quantization, as a peer to score beside our modes (``llmnpu eval --modes
et-16a8w ...``).

ExecuTorch's Qualcomm LLM flow quantizes the whole graph with its ``QnnQuantizer``: every op's
activations at 16 bits (or 8) with per-tensor min/max encodings, linear weights per output channel
at 8 or 4 bits. Its recipe for the embedded model (``Smollm2QuantRecipe``, in the ``executorch``
wheel's ``examples/qualcomm/oss_scripts/llama/static_llm_quant_recipe.py``) is 16a8w with min/max
observers. Here that quantizer annotates the Hugging Face model's exported graph (sequence length
dynamic), observes our calibration windows, and the converted fake-quant graph is the scorer: what
its QNN program would compute, up to HTP's rounding (``recipe_program`` lowers the same converted graph
whole to QNN, which ``llmnpu validate --recipe`` runs on the HTP simulator). The recipe's model also rotates Q and K by a
normalized Hadamard matrix after RoPE (SpinQuant's R3, ``r3 = True`` in that wheel's model config for
SmolLM2): Q·Kᵀ is unchanged in float, but the rotated K and Q, each with one 16-bit per-tensor
encoding, no longer carry a few outlier channels. Here it is a registered attention function that
rotates before the usual SDPA, for every model whose head dimension is a power of two (ExecuTorch
enables it for SmolLM2, Qwen2.5 and Qwen3; a Hadamard matrix of another size has no Sylvester
form, and those models score without it). The rotary embedding's cos and sin are computed in float
and quantized where the attention reads them, as that model's are (float tables, looked up by
position): quantizing the angles too, as the traced graph would, clips them at the calibration
windows' last position and garbles every token past it. Masked scores get -255 added, as in that
model, not the dtype's minimum (``MASK_VALUE``). Left out: that model's other rewrites (linears as
1x1 convolutions, its static K/V cache layout), which change no encoding.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import io
import logging
import operator

import torch
from torch import Tensor, nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from .chunk_step import attention_implementation, kv_shape
from .errors import LlmNpuError
from .models import LoadedModel
from .quantize.sqnr import sqnr_db

log = logging.getLogger(__name__)

# mode name -> ExecuTorch's QuantDtype member
RECIPES = {"et-16a8w": "use_16a8w", "et-16a4w": "use_16a4w", "et-8a8w": "use_8a8w"}

# ExecuTorch's CI floor for its QNN program of a model we ship (backends/qualcomm/tests/
# test_qnn_delegate.py, LlmSpecs): logits SQNR against the float model (its sqnr_eval, on one
# wikitext prompt of up to 1,024 tokens), a measure relative to fp32 and so comparable on our
# text. Its other floor, wikitext word perplexity <= 23, is absolute and wikitext's: on our
# Wikipedia extract fp32 itself scores 56 (docs/results.md), so it is not checked here.
ET_CI_GATES = {"smollm2-135m": {"logits_sqnr_db": 19.0}}


R3_ATTN_IMPLEMENTATION = "et-r3"
ET_ATTN_IMPLEMENTATION = "et-sdpa"      # the recipe's attention without R3

# The additive mask ExecuTorch's static llama gives a masked score (masking_utils.PADDING_MASK_VALUE;
# that module is not importable without its examples' dependencies). With the dtype's minimum the
# quantizer's 16-bit encoding of the masked scores spans ~65,550, so the softmax would read its
# input in steps of 1.0; -255 keeps them near the scores' own range, and still sends exp to 0.
MASK_VALUE = -255.0


@functools.lru_cache(maxsize=None)
def hadamard(n: int) -> Tensor:
    """The n x n Hadamard matrix (Sylvester's construction) scaled to be orthonormal, as ExecuTorch's
    static llama builds its R3 weight."""
    if n < 1 or n & (n - 1):
        raise LlmNpuError(f"a Hadamard matrix of Sylvester's form needs a power-of-two size, not {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _r3_attention(module, query, key, value, attention_mask, **kwargs):
    rotate = hadamard(query.shape[-1])      # cached by recipe_graph before the export
    return sdpa_attention_forward(module, torch.matmul(query, rotate), torch.matmul(key, rotate), value,
                                  attention_mask, **kwargs)


def _additive_mask(*args, **kwargs) -> Tensor:
    """Hugging Face's causal (and padding) mask as ExecuTorch's static llama adds it: 0 where a query
    sees a key, ``MASK_VALUE`` elsewhere, always materialized (never SDPA's ``is_causal``)."""
    kwargs["allow_is_causal_skip"] = False
    return torch.where(sdpa_mask(*args, **kwargs), 0.0, MASK_VALUE)


AttentionInterface.register(R3_ATTN_IMPLEMENTATION, _r3_attention)
AttentionInterface.register(ET_ATTN_IMPLEMENTATION, sdpa_attention_forward)
for _name in (R3_ATTN_IMPLEMENTATION, ET_ATTN_IMPLEMENTATION):
    ALL_MASK_ATTENTION_FUNCTIONS.register(_name, _additive_mask)


def _fake_quant(x: Tensor, scale: float, zero_point: int, quant_min: int, quant_max: int) -> Tensor:
    """quantize_per_tensor then dequantize_per_tensor, bit for bit (the integers are exact in float),
    in four passes over one new tensor where the decomposed pair makes eight and two dtype copies."""
    out = (x * (1.0 / scale)).round_()
    return out.clamp_(quant_min - zero_point, quant_max - zero_point).mul_(scale)


def _fold_fake_quant(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """The converted graph, computing the same numbers faster: each quantized activation is
    fake-quantized once for all its readers (the decomposed quantize and dequantize, the latter
    repeated per reader, are three quarters of the scorer's time). Weights stay as the recipe stores
    them (integers, dequantized per output channel at each call): a float copy would double memory."""
    ops = torch.ops.quantized_decomposed
    quantize, dequantize = ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default
    fused = {}      # quantize node -> its fake-quant node
    for node in list(graph.graph.nodes):
        source = node.args[0] if node.op == "call_function" and node.target is dequantize else None
        if source is None or source.target is not quantize or source.args[1:] != node.args[1:] or node.kwargs:
            continue
        if source not in fused:
            with graph.graph.inserting_after(source):
                fused[source] = graph.graph.call_function(_fake_quant, (source.args[0], *source.args[1:5]))
        node.replace_all_uses_with(fused[source])
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


class _Logits(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, ids: Tensor) -> Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


class _Output:
    def __init__(self, logits: Tensor, past: Tensor):
        self.logits, self.past_key_values = logits, past


class RecipeScorer(nn.Module):
    """The converted graph behind the calls a scorer gets (``input_ids``, ``past_key_values``,
    ``logits_to_keep``). It keeps no K/V: its "past" is the tokens so far, and each call runs them
    all again (static per-tensor encodings: a prefix's logits do not depend on what follows)."""

    keeps_kv = False    # a context shared by several endings saves nothing: score each whole

    def __init__(self, graph: nn.Module, dtype: str):
        super().__init__()
        self.graph, self.dtype = graph, dtype

    def forward(self, input_ids: Tensor, past_key_values: Tensor | None = None, use_cache: bool = False,
                logits_to_keep: int = 0, **_) -> _Output:
        ids = input_ids if past_key_values is None else torch.cat([past_key_values, input_ids], 1)
        logits = self.graph(ids)[:, -input_ids.shape[1]:]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return _Output(logits, ids)


def recipe_graph(lm: LoadedModel, example: Tensor, r3: bool = True) -> nn.Module:
    """``lm``'s model as the exported graph the quantizer annotates (sequence length dynamic), Q and K
    rotated by R3 when ``r3`` and its head dimension is a power of two."""
    config = lm.model.config
    if getattr(config, "attn_logit_softcapping", None):
        raise LlmNpuError(f"{lm.spec}'s attention softcaps its scores, which ExecuTorch's recipes (SDPA with an "
                          "additive mask) do not: score it with our modes only")
    head_dim = kv_shape(config).head_dim
    if r3 and head_dim & (head_dim - 1):
        log.info("R3 left out: head dimension %d is not a power of two", head_dim)
        r3 = False
    if r3:
        hadamard(head_dim)      # cached before the export: a constant of the graph, not traced ops
    seq = torch.export.Dim("seq", min=2, max=int(getattr(config, "max_position_embeddings", 2048)))
    # under no_grad: the rotary embedding's own no_grad would otherwise be a higher-order op the
    # quantizer's passes cannot read
    with torch.no_grad(), attention_implementation(lm.model, R3_ATTN_IMPLEMENTATION if r3 else ET_ATTN_IMPLEMENTATION):
        return torch.export.export(_Logits(lm.model).eval(), (example,), dynamic_shapes=({1: seq},),
                                   strict=False).module()


def rotary_nodes(graph: torch.fx.GraphModule) -> list[str]:
    """The nodes of the model's rotary embedding (positions to cos and sin), left unannotated."""
    def rotary(node) -> bool:
        stack = node.meta.get("nn_module_stack") or {}
        return any("RotaryEmbedding" in str(getattr(cls, "__name__", cls)) for _, cls in stack.values())

    return [node.name for node in graph.graph.nodes if node.op == "call_function" and rotary(node)]


def recipe_model(lm: LoadedModel, mode: str, calib_windows: Tensor, progress: bool = True,
                 r3: bool = True) -> RecipeScorer:
    """``lm``'s model quantized by ExecuTorch's Qualcomm quantizer with the setting ``mode`` (``RECIPES``),
    its encodings observed on ``calib_windows`` [n, length]; with the recipe's R3 rotation unless
    ``r3=False``."""
    return scorer_of(recipe_converted(lm, mode, calib_windows, progress, r3), mode)


def scorer_of(converted: torch.fx.GraphModule, mode: str) -> RecipeScorer:
    """The scorer of a converted recipe graph (which it folds in place: pass a copy to keep it)."""
    return RecipeScorer(_fold_fake_quant(converted), RECIPES[mode])


def recipe_converted(lm: LoadedModel, mode: str, calib_windows: Tensor, progress: bool = True,
                     r3: bool = True) -> torch.fx.GraphModule:
    """The converted (pt2e) graph of ``recipe_model``: quantize and dequantize nodes as ExecuTorch's
    lowering reads them."""
    if mode not in RECIPES:
        raise LlmNpuError(f"unknown ExecuTorch recipe {mode!r}: choose from {', '.join(RECIPES)}")
    from tqdm.auto import tqdm

    from .backends.qnn import qnn_quantizer

    quantizer = qnn_quantizer()
    from executorch.backends.qualcomm.quantizer.quantizer import QuantDtype
    from torchao.quantization.pt2e import MinMaxObserver
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = recipe_graph(lm, calib_windows[:1], r3)
    quantizer.add_discard_nodes(rotary_nodes(graph))
    quantizer.set_default_quant_config(getattr(QuantDtype, RECIPES[mode]), is_conv_per_channel=True,
                                       is_linear_per_channel=True, act_observer=MinMaxObserver)
    # the quantizer prints a line for every node of an op it has no config for (shape reads, clones,
    # aliases: nothing to quantize), hundreds per model: kept as one debug line instead
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        prepared = prepare_pt2e(graph, quantizer)
    skipped = sorted({line.rsplit(", ", 1)[-1] for line in printed.getvalue().splitlines() if line})
    log.debug("%s: ExecuTorch's quantizer left unannotated: %s", mode, ", ".join(skipped))
    with torch.no_grad():
        for window in tqdm(calib_windows, desc=f"{mode} calibration", unit="window", disable=not progress,
                           leave=False):
            prepared(window[None])
    return convert_pt2e(prepared)


def recipe_program(converted: torch.fx.GraphModule, example: Tensor, soc: str) -> bytes:
    """The recipe's QNN program for prompts of ``example``'s length on ``soc``: the converted graph whole
    as one HTP graph (``forward``: token ids to logits), for the HTP simulator to check the scorer on.
    At a fixed length everything that does not depend on the tokens is a constant, and is folded into
    one (``_fold_constants``): the causal mask, which Hugging Face builds with indexing (a rank-4
    Gather that HTP refuses) and the rotary tables (float, computed from the positions, which alone
    would be a graph without inputs). ExecuTorch's static llama takes both as inputs; the values are
    the same."""
    from .backends.qnn import to_qnn_edge

    static = _fold_constants(torch.export.export(converted, (example,), strict=False).module())
    edge = to_qnn_edge({"forward": (static, (example,))}, soc)
    left = sorted({_op_name(n) for n in edge.exported_program("forward").graph.nodes if n.op == "call_function"
                   and n.target is not operator.getitem and "call_delegate" not in str(n.target)})
    if left:
        hint = " (HTP's HadamardTransform takes 16-bit activations only: try --no-r3)" if "hadamard_transform" in left else ""
        raise LlmNpuError(f"HTP refused part of the recipe's graph ({', '.join(left)}), so its QNN program is not one "
                          f"HTP graph{hint}")
    return edge.to_executorch().buffer


def _op_name(node: torch.fx.Node) -> str:
    """``hadamard_transform`` for ``qnn_custom.hadamard_transform.default``."""
    parts = str(node.target).split(".")
    return parts[-2] if len(parts) > 2 else parts[-1]


def _fold_constants(graph: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """``graph`` with every node that reads no input replaced by its value (a buffer), except quantize
    and dequantize nodes, which the lowering must see: the weights stay integers with their scales."""
    ops = torch.ops.quantized_decomposed
    keep = {ops.quantize_per_tensor.default, ops.dequantize_per_tensor.default,
            ops.quantize_per_channel.default, ops.dequantize_per_channel.default}
    constant = set()
    for node in graph.graph.nodes:
        if node.op == "get_attr" or (node.op == "call_function" and node.target not in keep
                                      and all(n in constant for n in node.all_input_nodes)):
            constant.add(node)
    values = {}
    for node in graph.graph.nodes:
        if node not in constant:
            continue
        if node.op == "get_attr":
            values[node] = functools.reduce(getattr, node.target.split("."), graph)
        else:
            arg = values.__getitem__
            values[node] = node.target(*torch.fx.node.map_arg(node.args, arg), **torch.fx.node.map_arg(node.kwargs, arg))
    read = [n for n in graph.graph.nodes if n in constant and n.op == "call_function"
            and any(user not in constant for user in n.users)]
    for i, node in enumerate(read):
        graph.register_buffer(f"_folded_{i}", _as_stored(values[node], node.users))
        with graph.graph.inserting_before(node):
            node.replace_all_uses_with(graph.graph.get_attr(f"_folded_{i}"))
    graph.graph.eliminate_dead_code()
    graph.recompile()
    return graph


def _as_stored(value: Tensor, users) -> Tensor:
    """A folded constant as its one quantize user stores it (quantized, then dequantized). The QNN
    lowering quantizes a constant itself, rounding without a clamp: a value just past the encoding's
    top code wraps to its bottom one (cos(0) = 1.0 became -1.0, turning the first position's query
    around). Stored values round back to their own codes."""
    user = next(iter(users)) if len(users) == 1 else None
    if user is None or user.target is not torch.ops.quantized_decomposed.quantize_per_tensor.default \
            or not value.is_floating_point():
        return value
    scale, zero_point, quant_min, quant_max, _ = user.args[1:]
    return _fake_quant(value.float(), scale, zero_point, quant_min, quant_max)


def validate_recipe(lm: LoadedModel, mode: str, prompts: Tensor, calib_windows: Tensor, soc: str,
                    r3: bool = True, progress: bool = True) -> dict:
    """``llmnpu validate --recipe``: the recipe ``mode`` observed on ``calib_windows`` as ``llmnpu eval``
    scores it, and as its QNN program for ``soc`` computes it on the HTP simulator, on each of
    ``prompts`` [n, length] (evaluation text): the program's logits against the scorer's (does the
    scorer compute what the recipe's program does?) and both against the float model's."""
    from executorch.runtime import Runtime

    from . import backends

    converted = recipe_converted(lm, mode, calib_windows, progress, r3)
    scorer = scorer_of(copy.deepcopy(converted), mode)
    program = recipe_program(converted, prompts[:1], soc)
    backends.get("qnn").prepare_runtime()
    forward = Runtime.get().load_program(program).load_method("forward")
    rows = []
    for ids in prompts:
        with torch.no_grad():
            recipe = scorer(ids[None]).logits[0]
            fp32 = lm.model(input_ids=ids[None], use_cache=False).logits[0].float()
        htp = forward.execute([ids[None]])[0][0]
        rows.append({
            "logits_sqnr_db": {"htp_vs_recipe": round(sqnr_db(htp, recipe), 1),
                               "htp_vs_fp32": round(sqnr_db(htp, fp32), 1),
                               "recipe_vs_fp32": round(sqnr_db(recipe, fp32), 1)},
            # every position's greedy choice, the last one being the next token
            "top1_htp_is_recipe": round(float((htp.argmax(-1) == recipe.argmax(-1)).float().mean()), 4),
            "top1_htp_is_fp32": round(float((htp.argmax(-1) == fp32.argmax(-1)).float().mean()), 4),
            "top1_recipe_is_fp32": round(float((recipe.argmax(-1) == fp32.argmax(-1)).float().mean()), 4),
            "next_token": {"htp": int(htp[-1].argmax()), "recipe": int(recipe[-1].argmax()),
                           "fp32": int(fp32[-1].argmax())},
        })
    return {"recipe": mode, "r3": r3, "soc": soc, "prompt_tokens": prompts.shape[1],
            "program_bytes": len(program), "prompts": rows,
            "same_next_token": all(r["next_token"]["htp"] == r["next_token"]["recipe"] for r in rows)}
