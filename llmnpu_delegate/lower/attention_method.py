"""Chunk attention as one static NPU method: the graph a placement with attention on the NPU lowers.

One graph serves every chunk of a layer, as ExecuTorch's Qualcomm llama and Genie build theirs:
its shapes are fixed (the chunk's queries against a K/V window of the whole context), and what
changes from chunk to chunk comes in as inputs:

- ``q`` [KVH, G*C, d]: the chunk's queries after RoPE, times the attention's scaling (folded into
  the input's encoding: the codes are the unscaled query's), grouped by the K/V head they read;
- ``k``, ``v`` [KVH, W, d]: the window, the past and the chunk's own keys and values in place,
  empty slots anywhere;
- ``mask`` [1, G*C, W]: 0 where a query may look, ``mask_value`` where it may not (causal, and
  every empty slot).

Its numerics are ``kernels/npu_attention.py``'s, tensor for tensor: each input and result carries
the fixed encoding the reference rounds to (``AttentionEncodings``), annotated here as pt2e's fixed
parameters for ExecuTorch's Qualcomm quantizer: q, scores, probabilities and output as unsigned
16-bit, the window as signed symmetric 16-bit. Only a 16-bit window has this QNN form (the 8-bit
one is the engine's alone so far: HTP's 16 x 8-bit MatMul did not reproduce it).
"""
from __future__ import annotations

import torch
from torch import Tensor, fx, nn
from torchao.quantization.pt2e.quantizer import (
    QuantizationAnnotation,
    Quantizer,
    SharedQuantizationSpec,
)

from .. import backends
from ..errors import LlmNpuError
from ..kernels.npu_attention import PROBS, AttentionEncodings, Encoding
from .encodings import ANNOTATION, fixed_spec

QNN_KV_BITS = 16


class AttentionGraph(nn.Module):
    """softmax(q k^T + mask) v on the static shapes of one chunk against the window."""

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor) -> Tensor:
        scores = torch.bmm(q, k.transpose(1, 2)) + mask
        return torch.bmm(torch.softmax(scores, dim=-1), v)


def mask_value(enc: AttentionEncodings) -> float:
    """What the mask adds to a hidden key: enough to take any score below the scores' floor."""
    return 2 * (enc.scores.floor - (2 ** enc.scores.bits - 1 - enc.scores.zero) * enc.scores.scale)


def graph_inputs(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scaling: float, enc: AttentionEncodings):
    """The method's inputs from ``npu_attention``'s (q [1, H, C, d], k/v [1, KVH, W, d], allowed
    [C, W] bool)."""
    _, h, c, d = q.shape
    kvh = k.shape[1]
    mask = torch.where(allowed.reshape(c, -1), 0.0, mask_value(enc)).repeat(h // kvh, 1)[None]
    return (q.float() * scaling).reshape(kvh, h // kvh * c, d), k[0].float(), v[0].float(), mask


def output_of(out: Tensor, heads: int) -> Tensor:
    """The method's output [KVH, G*C, d] as ``npu_attention`` returns it: [1, C, H, d]."""
    kvh, gc, d = out.shape
    return out.reshape(1, heads, gc * kvh // heads, d).transpose(1, 2)


class AttentionQuantizer(Quantizer):
    """Annotates ``AttentionGraph``'s exported ops with one layer's encodings."""

    def __init__(self, enc: AttentionEncodings, scaling: float):
        super().__init__()
        if enc.k.bits != QNN_KV_BITS or enc.v.bits != QNN_KV_BITS:
            raise LlmNpuError(f"attention's QNN method holds a {QNN_KV_BITS}-bit K/V window, not {enc.k.bits}-bit: "
                              f"use npu_kv_bits={QNN_KV_BITS}")
        self.enc, self.scaling = enc, scaling

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        enc = self.enc
        floor = mask_value(enc)
        mask = Encoding.of_range(floor, 0.0, enc.scores.bits)
        ops = [n for n in model.graph.nodes if n.op == "call_function" and n.target != getattr]
        names = [str(n.target).split(".")[-2] if "." in str(n.target) else str(n.target) for n in ops]
        if names != ["transpose", "bmm", "add", "softmax", "bmm"]:
            raise LlmNpuError(f"unexpected attention graph: {', '.join(names)}")
        transpose, qk, add, softmax, pv = ops
        shared = SharedQuantizationSpec
        transpose.meta[ANNOTATION] = QuantizationAnnotation({transpose.args[0]: fixed_spec(enc.k)},
                                                            shared((transpose.args[0], transpose)), _annotated=True)
        qk.meta[ANNOTATION] = QuantizationAnnotation(
            {qk.args[0]: fixed_spec(enc.q, enc.q.scale * self.scaling), qk.args[1]: shared((transpose.args[0], transpose))},
            fixed_spec(enc.scores), _annotated=True)
        add.meta[ANNOTATION] = QuantizationAnnotation({add.args[0]: shared(qk), add.args[1]: fixed_spec(mask)},
                                                      fixed_spec(enc.scores), _annotated=True)
        softmax.meta[ANNOTATION] = QuantizationAnnotation({softmax.args[0]: shared(add)}, fixed_spec(PROBS),
                                                          _annotated=True)
        pv.meta[ANNOTATION] = QuantizationAnnotation({pv.args[0]: shared(softmax), pv.args[1]: fixed_spec(enc.v)},
                                                     fixed_spec(enc.out), _annotated=True)
        return model

    def validate(self, model: fx.GraphModule) -> None:
        pass


def quantized_attention(enc: AttentionEncodings, scaling: float, example: tuple):
    """The converted (pt2e) graph with ``enc``'s encodings, for the shapes of ``example``
    (``graph_inputs``). Every encoding is fixed, so one call calibrates it."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = torch.export.export(AttentionGraph(), example, strict=False).module()
    prepared = prepare_pt2e(graph, backends.get("qnn").quantizer(AttentionQuantizer(enc, scaling)))
    with torch.no_grad():
        prepared(*example)
    return convert_pt2e(prepared)


def lower_attention(method: str, enc: AttentionEncodings, scaling: float, example: tuple, soc: str | None = None):
    """The attention method lowered whole to one HTP context binary for ``soc``."""
    converted = quantized_attention(enc, scaling, example)
    return backends.get("qnn").lower({method: (converted, example)}, soc)
