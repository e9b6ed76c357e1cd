"""Our quantization encodings as pt2e annotations: what a QNN or XNNPACK program computes is ours.

``LlmNpuQuantizer`` annotates each decoder linear of an exported graph with *fixed* parameters:
the input activation gets the plan's static per-tensor scale (clip / 127 for shadowed layers, the
absolute maximum / 127 for the others), the weight our symmetric INT8 scales (per output channel or
per tensor: max |w| / 127, exactly ``quantize_weight``). Nothing is left to an observer except the
linear's output encoding, which an integer NPU graph needs and our INT8 engine does not have (it
dequantizes the int32 accumulator): that one is observed (min/max) on calibration input, unless it
is fixed too (``fixed_outputs``: a fine second encoding, ``npu_subgraphs.fine_outputs``).

A ``wide`` linear (``qnn`` only: a residual writer under ``ExportConfig.residual_bits`` 16) takes its
input at 16 bits on a grid that holds the INT8 grid's values exactly (HTP refuses an 8-bit input
with a 16-bit output), so its integer product is the same up to a factor; its output is observed
at 16 bits.

With float outputs (``output_bits=32``, ``npu_subgraphs.FloatOutputRegion``) the input is annotated
as XNNPACK's dynamic INT8 and the output not at all: the region's sentinel columns make the dynamic
scale the plan's, so the GEMM is the same integer product with a float result.

Two flavours of the same numbers: ``"qnn"`` writes activations as uint8 with zero point 128 (what
HTP prefers), ``"xnnpack"`` as int8 with zero point 0: both are round(x / s) with the same scale.
"""
from __future__ import annotations

import torch
from torch import fx
from torchao.quantization.pt2e import MinMaxObserver, PerChannelMinMaxObserver, PlaceholderObserver
from torchao.quantization.pt2e.quantizer import (
    DerivedQuantizationSpec,
    FixedQParamsQuantizationSpec,
    QuantizationAnnotation,
    QuantizationSpec,
    Quantizer,
)

from ..errors import LlmNpuError
from ..kernels import QMAX
from ..partitioner.regions import linear_names
from ..quantize.apply import LinearPlan

ANNOTATION = "quantization_annotation"
SKIP = "llmnpu_float"          # node meta flag: a linear that must stay float (a shadow product)
FLAVOURS = ("qnn", "xnnpack")


def activation_spec(scale: float, flavour: str) -> FixedQParamsQuantizationSpec:
    # Full 8-bit range: the integer kernels saturate at -128 whatever quant_min says, so the
    # reference graph must too. (Our engine stops at -127: one step apart, below -127.5 * scale only.)
    if flavour == "qnn":
        return FixedQParamsQuantizationSpec(torch.uint8, scale, 128, 0, 255, torch.per_tensor_affine)
    return FixedQParamsQuantizationSpec(torch.int8, scale, 0, -128, 127, torch.per_tensor_affine)


def fixed_spec(enc, scale: float | None = None) -> FixedQParamsQuantizationSpec:
    """A fixed encoding (``kernels.npu_attention.Encoding``) as pt2e's fixed parameters; ``scale``
    overrides its scale (a factor folded into it)."""
    lo, hi = enc.codes
    if enc.signed:
        return FixedQParamsQuantizationSpec(torch.int16, enc.scale, 0, lo, hi, torch.per_tensor_symmetric)
    # QNN's 16-bit activations travel as int32 holding unsigned codes (ExecuTorch's 16-bit configs)
    return FixedQParamsQuantizationSpec(torch.int32, scale or enc.scale, enc.zero, lo, hi, torch.per_tensor_affine)


def dynamic_spec() -> QuantizationSpec:
    """XNNPACK's dynamic INT8 activation: scale and zero point from each row's range at run time."""
    return QuantizationSpec(torch.int8, PlaceholderObserver, quant_min=-128, quant_max=127,
                            qscheme=torch.per_tensor_affine, is_dynamic=True)


def weight_spec(granularity: str) -> QuantizationSpec:
    if granularity == "channel":
        return QuantizationSpec(torch.int8, PerChannelMinMaxObserver, quant_min=-QMAX, quant_max=QMAX,
                                qscheme=torch.per_channel_symmetric, ch_axis=0)
    return QuantizationSpec(torch.int8, MinMaxObserver, quant_min=-QMAX, quant_max=QMAX,
                            qscheme=torch.per_tensor_symmetric)


WIDE_BITS = 16
WIDE_ZERO = 1 << (WIDE_BITS - 1)


def wide_activation_spec(scale: float) -> FixedQParamsQuantizationSpec:
    """A wide linear's input: the INT8 grid's values (``activation_spec``'s scale) as 16-bit codes,
    int32 holding unsigned ones as QNN's 16-bit configs do. The step is 1/256 of the INT8 grid's, so
    its values are codes 256 apart across the whole 16-bit range: on the grid's own step (codes
    32768 +- 127) HTP's 16-bit products came out hundreds of output steps off, on this one within a
    step (``tests/test_qnn.py``)."""
    return FixedQParamsQuantizationSpec(torch.int32, scale / 256, WIDE_ZERO, 0, (1 << WIDE_BITS) - 1, torch.per_tensor_affine)


def output_spec(flavour: str, fixed: tuple[float, int] | None = None, bits: int = 8) -> QuantizationSpec:
    if bits == WIDE_BITS:
        if flavour != "qnn" or fixed is not None:
            raise LlmNpuError("a 16-bit output is a qnn linear's, observed (no second encoding)")
        return QuantizationSpec(torch.int32, MinMaxObserver, quant_min=0, quant_max=(1 << WIDE_BITS) - 1,
                                qscheme=torch.per_tensor_affine)
    dtype, lo, hi = (torch.uint8, 0, 255) if flavour == "qnn" else (torch.int8, -128, 127)
    if fixed is not None:
        return FixedQParamsQuantizationSpec(dtype, fixed[0], fixed[1], lo, hi, torch.per_tensor_affine)
    # min/max, not a histogram: an output clipped for a lower mean error would saturate exactly the
    # large values the shadow path exists to keep
    return QuantizationSpec(dtype, MinMaxObserver, quant_min=lo, quant_max=hi, qscheme=torch.per_tensor_affine)


def _bias_spec(act: fx.Node, weight: fx.Node, linear: fx.Node, granularity: str) -> DerivedQuantizationSpec:
    def derive(observers):
        a_scale, _ = observers[0].calculate_qparams()
        w_scale, _ = observers[1].calculate_qparams()
        scale = (a_scale * w_scale).to(torch.float32)
        return scale, torch.zeros_like(scale, dtype=torch.int32)

    per_channel = granularity == "channel"
    return DerivedQuantizationSpec(
        derived_from=[(act, linear), (weight, linear)], derive_qparams_fn=derive, dtype=torch.int32,
        quant_min=torch.iinfo(torch.int32).min, quant_max=torch.iinfo(torch.int32).max,
        qscheme=torch.per_channel_symmetric if per_channel else torch.per_tensor_symmetric,
        ch_axis=0 if per_channel else None)


class LlmNpuQuantizer(Quantizer):
    """Annotates the decoder linears named in ``plans`` with our fixed encodings (see module doc);
    those named in ``wide`` at 16 bits in and out."""

    def __init__(self, plans: dict[str, LinearPlan], granularity: str = "channel", flavour: str = "qnn",
                 prefix: str = "", output_bits: int = 8, fixed_outputs: dict[str, tuple[float, int]] | None = None,
                 wide: frozenset[str] = frozenset()):
        super().__init__()
        if flavour not in FLAVOURS:
            raise LlmNpuError(f"unknown encoding flavour '{flavour}': use one of {FLAVOURS}")
        if wide and (flavour != "qnn" or output_bits != 8):
            raise LlmNpuError("16-bit linears are a qnn program's with integer outputs")
        self.plans, self.granularity, self.flavour, self.prefix = plans, granularity, flavour, prefix
        self.output_bits, self.fixed_outputs, self.wide = output_bits, fixed_outputs or {}, wide

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        found = linear_names(model, self.plans, self.prefix)
        if not found:
            raise LlmNpuError("no decoder linear of the quantization plan was found in the graph")
        for node, name in found.items():
            if node.meta.get(SKIP):
                continue
            act, weight = node.args[0], node.args[1]
            floats, wide = self.output_bits == 32, name in self.wide
            scale = self.plans[name].act_scale
            qspecs = {act: dynamic_spec() if floats else wide_activation_spec(scale) if wide
                      else activation_spec(scale, self.flavour), weight: weight_spec(self.granularity)}
            bias = node.args[2] if len(node.args) > 2 else None
            # QNN takes an int32 bias on the accumulator's scale; XNNPACK takes it float and does that itself
            if isinstance(bias, fx.Node) and self.flavour == "qnn":
                qspecs[bias] = _bias_spec(act, weight, node, self.granularity)
            node.meta[ANNOTATION] = QuantizationAnnotation(
                input_qspec_map=qspecs, _annotated=True,
                output_qspec=None if floats else output_spec(self.flavour, self.fixed_outputs.get(name),
                                                             WIDE_BITS if wide else 8))
        return model

    def validate(self, model: fx.GraphModule) -> None:
        pass
