"""A block's RMSNorm as a static HTP graph: the piece a placement with norms on the NPU lowers.

The graph is ``rms_norm(x, weight)`` on rows of the residual stream; its numerics are
``kernels/npu_norm.py``'s: the input, weight and output carry that norm's fixed 16-bit encodings
(``NormEncodings``), annotated here as pt2e's fixed parameters for ExecuTorch's Qualcomm quantizer,
which lowers the op to HTP's RmsNorm.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer

from .. import backends
from ..errors import LlmNpuError
from ..kernels.npu_norm import NormEncodings
from .encodings import ANNOTATION, fixed_spec


class NormGraph(nn.Module):
    def __init__(self, weight: Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        self.eps = float(eps)

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class NormQuantizer(Quantizer):
    """Annotates ``NormGraph``'s exported ``rms_norm`` with one norm's encodings."""

    def __init__(self, enc: NormEncodings):
        super().__init__()
        self.enc = enc

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        norms = [n for n in model.graph.nodes if n.op == "call_function" and n.target == torch.ops.aten.rms_norm.default]
        if len(norms) != 1:
            raise LlmNpuError(f"unexpected norm graph: {len(norms)} rms_norm ops")
        (norm,) = norms
        norm.meta[ANNOTATION] = QuantizationAnnotation(
            {norm.args[0]: fixed_spec(self.enc.x), norm.args[2]: fixed_spec(self.enc.weight)}, fixed_spec(self.enc.out),
            _annotated=True)
        return model

    def validate(self, model: fx.GraphModule) -> None:
        pass


def quantized_norm(enc: NormEncodings, weight: Tensor, eps: float, example: tuple):
    """The converted (pt2e) graph at ``enc``'s encodings for the rows of ``example`` ((x,)). Every
    encoding is fixed, so one call calibrates it."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    graph = torch.export.export(NormGraph(weight, eps), example, strict=False).module()
    prepared = prepare_pt2e(graph, backends.get("qnn").quantizer(NormQuantizer(enc)))
    with torch.no_grad():
        prepared(*example)
    return convert_pt2e(prepared)


def lower_norm(method: str, enc: NormEncodings, weight: Tensor, eps: float, example: tuple, soc: str | None = None):
    """The norm lowered whole to one HTP context binary for ``soc``."""
    return backends.get("qnn").lower({method: (quantized_norm(enc, weight, eps, example), example)}, soc)
