"""A block norm and the linears it feeds as one integer NPU graph: a QNN program's region when the
placement puts the norms on the NPU (``norms``).

HTP computes, in one graph:

- the norm at its 16-bit encodings (``kernels/npu_norm.py``; ``norm_method.py`` lowers it alone);
- the normed rows clamped to each activation group's INT8 grid, +-127 codes of the plan's scale
  (our ``quantize`` stops there; HTP's 8-bit range reaches -128), and requantized to it;
- the linears as a linears-only region's (``npu_subgraphs.RegionModule``: our weights, 8-bit outputs,
  split channel groups, second encodings).

The method takes the region's input rows on the norm's input grid (a runner rounds them, as it puts
a linears-only region's rows on their INT8 grids: HTP's own float conversion rounds otherwise) and
returns the subgraph's outputs that no linear makes (the normed rows, at 16 bits: the CPU's shadow
products read them), then ``RegionModule``'s outputs, which a runner merges as it merges a
linears-only method's (``RegionSpec.merge``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation

from .. import backends
from ..errors import LlmNpuError
from ..format.npu_io import RegionSpec
from ..kernels.npu_norm import NormEncodings, norm_key, npu_rms_norm
from ..partitioner.patterns import rms_norm_chains
from ..partitioner.placement import innermost_module
from ..partitioner.regions import Partition, Subgraph, is_linear, subgraph_module
from .encodings import ANNOTATION, LlmNpuQuantizer, activation_spec, fixed_spec
from .npu_subgraphs import RegionModule, check_delegated, fixed_outputs, output_encodings, plan_names

REGION = "region."      # RegionModule's path inside NormRegion


@dataclass(frozen=True)
class NormRegionShape:
    """An NPU subgraph that is one block norm feeding linears: the norm's key ((layer, name)), its
    weight and eps, the subgraph's outputs no linear makes (the normed rows, where a shadow product
    reads them, or none) and each linear's output."""
    norm: tuple[int, str]
    weight: Tensor
    eps: float
    others: list[str]
    linear_outputs: list[str]


def norm_region_shape(partition: Partition, sub: Subgraph) -> NormRegionShape | None:
    """``sub`` as one norm of its input whose output feeds all of its linears, with nothing else in
    it; None for any other subgraph."""
    if sub.kind != "npu" or len(sub.inputs) != 1 or not sub.linears:
        return None
    gm = subgraph_module(partition, sub)
    chains = rms_norm_chains(gm.graph)
    if len(chains) != 1:
        return None
    (chain,) = chains
    linears = [n for n in gm.graph.nodes if is_linear(n)]
    work = [n for n in gm.graph.nodes if n.op == "call_function" and not is_linear(n)]
    if chain.x.op != "placeholder" or any(n not in chain.nodes for n in work) or \
            any(lin.args[0] is not chain.final for lin in linears):
        return None
    key = norm_key(innermost_module(chain.final)[0])
    if key is None:
        return None
    made = {n.name for n in linears}
    others = [o for o in sub.outputs if o not in made]
    if others not in ([], [chain.final.name]):
        return None
    weight = operator.attrgetter(chain.weight.target)(gm)        # a parameter or a buffer
    return NormRegionShape(key, weight.detach(), float(chain.eps), others, [n.name for n in linears])


class NormRegion(nn.Module):
    """The region as a module: rows in; the normed rows (if ``normed_out``: a shadow product reads
    them), then ``RegionModule``'s outputs on each activation group's clamped rows."""

    def __init__(self, weight: Tensor, eps: float, linears: list[nn.Linear], spec: RegionSpec, normed_out: bool):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        self.eps, self.scales, self.normed_out = float(eps), list(spec.scales), normed_out
        self.region = RegionModule(linears, spec.groups, spec.splits, spec.fine)

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        normed = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        outs = self.region(*(torch.clamp(normed, -127.0 * s, 127.0 * s) for s in self.scales))
        return (normed, *outs) if self.normed_out else outs


class NormRegionAnnotation:
    """Annotates ``NormRegion``'s norm with its 16-bit encodings and each clamp with its group's 8-bit
    input encoding (the clamp is where HTP requantizes 16 bits to 8)."""

    def __init__(self, enc: NormEncodings, scales: list[float]):
        self.enc, self.scales = enc, scales

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        nodes = [n for n in model.graph.nodes if n.op == "call_function"]
        norms = [n for n in nodes if n.target == torch.ops.aten.rms_norm.default]
        clamps = [n for n in nodes if n.target == torch.ops.aten.clamp.default]
        if len(norms) != 1 or len(clamps) != len(self.scales):
            raise LlmNpuError(f"unexpected norm region graph: {len(norms)} norms, {len(clamps)} clamps for "
                              f"{len(self.scales)} activation groups")
        (norm,) = norms
        annotate_norm(norm, self.enc)
        for clamp, scale in zip(clamps, self.scales):
            clamp.meta[ANNOTATION] = QuantizationAnnotation({norm: fixed_spec(self.enc.out)}, fixed_spec(self.enc.out),
                                                            _annotated=True)
        return model


def annotate_norm(norm: fx.Node, enc: NormEncodings) -> None:
    """An ``aten.rms_norm`` at ``enc``'s 16-bit encodings: its input, weight and output."""
    norm.meta[ANNOTATION] = QuantizationAnnotation({norm.args[0]: fixed_spec(enc.x), norm.args[2]: fixed_spec(enc.weight)},
                                                   fixed_spec(enc.out), _annotated=True)


def linear_inputs(rows: Tensor, shape: NormRegionShape, enc: NormEncodings, spec: RegionSpec) -> dict[int, Tensor]:
    """Per linear, what its INT8 product reads from ``rows`` (the region's input, on its grid): the
    16-bit normed rows on its group's INT8 grid. Split channels and second encodings are chosen on these."""
    return spec.linear_reads(npu_rms_norm(rows, shape.weight, shape.eps, enc))


def quantized_norm_region(shape: NormRegionShape, enc: NormEncodings, linears: list[nn.Linear], spec: RegionSpec,
                          plans: dict, granularity: str, calib_rows: Tensor, rows_per_call: int):
    """The region exported for ``rows_per_call`` rows, annotated (the norm and the inputs fixed, the
    linears' output encodings observed on every block of ``calib_rows``, which lie on the norm's input
    grid), converted (pt2e). Returns (graph, example inputs)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    if calib_rows.shape[0] % rows_per_call:
        raise LlmNpuError(f"{calib_rows.shape[0]} calibration rows are not a whole number of {rows_per_call}-row calls")
    module = NormRegion(shape.weight, shape.eps, linears, spec, bool(shape.others)).eval()
    example = (calib_rows[:rows_per_call],)
    graph = torch.export.export(module, example, strict=False).module()
    local = {REGION + k: v for k, v in plan_names(spec, plans).items()}
    ours = LlmNpuQuantizer(local, granularity, flavour="qnn",
                           fixed_outputs={REGION + k: v for k, v in fixed_outputs(spec, "qnn").items()})
    prepared = prepare_pt2e(graph, backends.get("qnn").quantizer(ours, NormRegionAnnotation(enc, spec.scales)))
    with torch.no_grad():
        for block in calib_rows.split(rows_per_call):
            prepared(block)
    return convert_pt2e(prepared), example


def lower_norm_region(shape: NormRegionShape, enc: NormEncodings, linears: list[nn.Linear], spec: RegionSpec,
                      plans: dict, granularity: str, calib_rows: Tensor, rows_per_call: int, soc: str | None):
    """The region lowered to one HTP context binary; returns (edge program manager, the encodings of
    RegionModule's outputs, as ``npu_subgraphs.output_encodings`` gives a linears-only region's)."""
    graph, example = quantized_norm_region(shape, enc, linears, spec, plans, granularity, calib_rows, rows_per_call)
    encodings = output_encodings(graph)[len(shape.others):]
    edge = backends.get("qnn").lower(spec.method, graph, example, soc)
    check_delegated(edge, spec, "qnn")
    return edge, encodings
