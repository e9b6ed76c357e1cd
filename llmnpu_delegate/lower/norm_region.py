"""A block norm and the linears it feeds as one integer NPU graph: a QNN program's region when the
placement puts the norms on the NPU (``norms``).

HTP computes, in one graph:

- the norm at its 16-bit encodings (``kernels/npu_norm.py``; ``norm_method.py`` lowers it alone);
- the normed rows clamped to each activation group's INT8 grid, +-127 codes of the plan's scale
  (our ``quantize`` stops there; HTP's 8-bit range reaches -128), and requantized to it;
- the linears as a linears-only region's (``npu_subgraphs.RegionModule``: our weights, 8-bit outputs,
  split channel groups, second encodings);
- under placement piece ``peak``, each norm reader's shadow product over its peak channels
  (``PeakBranch``): the channels picked from the 16-bit normed rows by a one-hot GEMM (HTP's Gather
  refuses 16-bit data), their residues beyond the clip at 16 bits, times W's columns of them at 8
  bits, a 16-bit output. The sum stays out of the graph: forming it inside would take the linear's
  8-bit parts (split channel groups, second encodings) merged inside too, which only a graph that
  goes on to attention needs. Here the product is one more output, which a runner adds when it
  merges the linear's parts.

The method takes the region's input rows on the norm's input grid (a runner rounds them, as it puts
a linears-only region's rows on their INT8 grids: HTP's own float conversion rounds otherwise) and
returns the subgraph's outputs that no linear makes (the normed rows, at 16 bits: the CPU's shadow
products read them), then ``RegionModule``'s outputs and the peak products, which a runner merges as
it merges a linears-only method's (``RegionSpec.merge``, ``RegionSpec.peaks``).
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
from ..kernels.npu_attention import Encoding
from ..kernels.npu_norm import NormEncodings, norm_key, npu_rms_norm
from ..partitioner.patterns import rms_norm_chains
from ..partitioner.placement import PEAK, innermost_module
from ..partitioner.regions import Partition, Subgraph, is_linear, peak_delta, subgraph_module, weight_name_of
from .encodings import ANNOTATION, LlmNpuQuantizer, activation_spec, fixed_spec, weight_spec
from .npu_subgraphs import Converted, RegionModule, fixed_outputs, lower_converted, output_encodings, plan_names

REGION = "region."      # RegionModule's path inside NormRegion


@dataclass(frozen=True)
class NormRegionShape:
    """An NPU subgraph that is one block norm feeding linears: the norm's key ((layer, name)), its
    weight and eps, the subgraph's outputs no linear makes (the normed rows, where a shadow product
    reads them, or none), each linear's output (with its peak product added, where it has one) and
    the linears whose peak product the subgraph holds (placement piece ``peak``), by name."""
    norm: tuple[int, str]
    weight: Tensor
    eps: float
    others: list[str]
    linear_outputs: list[str]
    peaks: tuple[str, ...] = ()


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
    output_of, peaks = _peak_sums(gm, chain.final)
    if output_of is None:
        return None
    work = [n for n in gm.graph.nodes if n.op == "call_function" and not is_linear(n) and n not in output_of.values()
            and not (n.target is peak_delta)]
    if chain.x.op != "placeholder" or any(n not in chain.nodes for n in work) or \
            any(lin.args[0] is not chain.final for lin in linears):
        return None
    key = norm_key(innermost_module(chain.final)[0])
    if key is None:
        return None
    outputs = [output_of.get(n, n).name for n in linears]
    others = [o for o in sub.outputs if o not in outputs]
    if others not in ([], [chain.final.name]):
        return None
    weight = operator.attrgetter(chain.weight.target)(gm)        # a parameter or a buffer
    return NormRegionShape(key, weight.detach(), float(chain.eps), others, outputs,
                           tuple(peaks[n] for n in linears if n in peaks))


def _peak_sums(gm: fx.GraphModule, normed: fx.Node) -> tuple[dict | None, dict]:
    """({linear: the add of its peak product}, {linear: its name}) for each ``linear + peak_delta``
    of the normed rows in ``gm``; (None, {}) if a peak product is anything else."""
    output_of, names = {}, {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not peak_delta:
            continue
        sums = list(node.users)
        if node.args[0] is not normed or len(sums) != 1 or not sums[0].meta.get(PEAK) or \
                sums[0].target is not operator.add:
            return None, {}
        (lin,) = [a for a in sums[0].args if a is not node]
        if not is_linear(lin) or len(lin.users) != 1:
            return None, {}
        output_of[lin], names[lin] = sums[0], node.args[1]
    return output_of, names


@dataclass(frozen=True)
class Peak:
    """A norm reader's shadow product over its peak channels in the region's graph: the channels
    (``LinearPlan.peak``), the clip, and its 16-bit grids: the residues and the product."""
    channels: Tensor
    clip: float
    residue: Encoding
    out: Encoding


class PeakBranch(nn.Module):
    """``(x - clip(x))[:, P] @ W[:, P]^T`` as HTP lowers it: P picked by a one-hot GEMM."""

    def __init__(self, weight: Tensor, channels: Tensor, clip: float):
        super().__init__()
        self.pick = nn.Linear(weight.shape[1], channels.numel(), bias=False)
        self.rows = nn.Linear(channels.numel(), weight.shape[0], bias=False)
        with torch.no_grad():
            self.pick.weight.copy_(F.one_hot(channels.long(), weight.shape[1]).float())
            self.rows.weight.copy_(weight.detach().float()[:, channels.long()])
        self.clip = float(clip)

    def forward(self, normed: Tensor) -> Tensor:
        picked = self.pick(normed)
        return self.rows(picked - torch.clamp(picked, -self.clip, self.clip))


def peak_grids(weight: Tensor, channels: Tensor, clip: float, normed: Encoding, norm_weight: Tensor) -> Peak:
    """A peak product's 16-bit grids, spanning every residue and product the graph can meet, so that
    neither saturates on any prompt. A normed value lies within the normed rows' encoding (``normed``)
    and within sqrt(d) |g_c| of channel c (RMSNorm divides by a root mean square at least |x_c| /
    sqrt(d)); its residue beyond the clip lies within what is left of either, and the product within
    the sum of those bounds times W's columns. One step of the normed grid more holds its rounding
    (and the residue grid's, which is finer). Grids taken from calibration rows instead saturated on
    other text in nearly every peak linear of the embedded model."""
    channels = channels.long()
    if not channels.numel():
        return Peak(channels, float(clip), Encoding.of_range(0, 0, 16), Encoding.of_range(0, 0, 16))
    reach = norm_weight.detach().float()[channels].abs() * weight.shape[1] ** 0.5 + normed.scale
    hi = (torch.clamp(reach, max=normed.ceiling) - clip).clamp(min=0)
    lo = (torch.clamp(-reach, min=normed.floor) + clip).clamp(max=0)
    cols = weight.detach().float()[:, channels]
    product_hi = torch.maximum(cols * hi, cols * lo).sum(1)
    product_lo = torch.minimum(cols * hi, cols * lo).sum(1)
    return Peak(channels, float(clip), Encoding.of_range(float(lo.min()), float(hi.max()), 16),
                Encoding.of_range(float(product_lo.min()), float(product_hi.max()), 16))


class NormRegion(nn.Module):
    """The region as a module: rows in; the normed rows (if ``normed_out``: a shadow product reads
    them), then ``RegionModule``'s outputs on each activation group's clamped rows, then the peak
    products (``peaks``: linear index -> its ``Peak``) in the linears' order."""

    def __init__(self, weight: Tensor, eps: float, linears: list[nn.Linear], spec: RegionSpec, normed_out: bool,
                 peaks: dict[int, Peak] | None = None):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float().clone(), requires_grad=False)
        self.eps, self.scales, self.normed_out = float(eps), list(spec.scales), normed_out
        self.region = RegionModule(linears, spec.groups, spec.splits, spec.fine)
        peaks = peaks or {}
        self.peaks = nn.ModuleList(PeakBranch(linears[i].weight, peaks[i].channels, peaks[i].clip)
                                   for i in sorted(peaks))

    def forward(self, x: Tensor) -> tuple[Tensor, ...]:
        normed = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        outs = self.region(*(torch.clamp(normed, -127.0 * s, 127.0 * s) for s in self.scales))
        outs = (*outs, *(branch(normed) for branch in self.peaks))
        return (normed, *outs) if self.normed_out else outs


class NormRegionAnnotation:
    """Annotates ``NormRegion``'s norm with its 16-bit encodings, each clamp of the normed rows at
    their encoding (the linears' 8-bit inputs then requantize it), and each peak product at its
    grids (``peaks``, in ``NormRegion.peaks``' order)."""

    def __init__(self, enc: NormEncodings, scales: list[float], peaks: list[Peak] = ()):
        self.enc, self.scales, self.peaks = enc, scales, list(peaks)

    def annotate(self, model: fx.GraphModule) -> fx.GraphModule:
        nodes = [n for n in model.graph.nodes if n.op == "call_function"]
        norms = [n for n in nodes if n.target == torch.ops.aten.rms_norm.default]
        clamps = [n for n in nodes if n.target == torch.ops.aten.clamp.default and n.args[0] in norms]
        if len(norms) != 1 or len(clamps) != len(self.scales):
            raise LlmNpuError(f"unexpected norm region graph: {len(norms)} norms, {len(clamps)} clamps for "
                              f"{len(self.scales)} activation groups")
        (norm,) = norms
        annotate_norm(norm, self.enc)
        for clamp, scale in zip(clamps, self.scales):
            clamp.meta[ANNOTATION] = QuantizationAnnotation({norm: fixed_spec(self.enc.out)}, fixed_spec(self.enc.out),
                                                            _annotated=True)
        by_weight = {weight_name_of(n): n for n in nodes if is_linear(n)}
        for j, peak in enumerate(self.peaks):
            pick, rows = by_weight.get(f"peaks.{j}.pick.weight"), by_weight.get(f"peaks.{j}.rows.weight")
            if pick is None or rows is None or pick.args[0] is not norm:
                raise LlmNpuError(f"unexpected norm region graph: peak product {j} is not pick -> residue -> rows")
            annotate_peak(pick, rows, self.enc.out, peak)
        return model


def annotate_peak(pick: fx.Node, rows: fx.Node, normed: Encoding, peak: Peak) -> None:
    """One ``PeakBranch`` at its grids: the pick exact on the normed rows' encoding, the clamp on its
    own range (lowering may fold a clamp into its output's encoding), the residues and the product
    on theirs; both GEMMs' weights per output channel at 8 bits (the one-hot rows are exact; 16-bit
    weights for W's columns measured no closer to the engine on the embedded model)."""
    sub = rows.args[0]
    clamp = next(a for a in sub.args if a is not pick)
    pick.meta[ANNOTATION] = QuantizationAnnotation({pick.args[0]: fixed_spec(normed), pick.args[1]: weight_spec("channel")},
                                                   fixed_spec(normed), _annotated=True)
    clamp.meta[ANNOTATION] = QuantizationAnnotation({pick: fixed_spec(normed)},
                                                    fixed_spec(Encoding.of_range(-peak.clip, peak.clip, 16)),
                                                    _annotated=True)
    sub.meta[ANNOTATION] = QuantizationAnnotation({}, fixed_spec(peak.residue), _annotated=True)
    rows.meta[ANNOTATION] = QuantizationAnnotation({sub: fixed_spec(peak.residue), rows.args[1]: weight_spec("channel")},
                                                   fixed_spec(peak.out), _annotated=True)


def annotate_norm(norm: fx.Node, enc: NormEncodings) -> None:
    """An ``aten.rms_norm`` at ``enc``'s 16-bit encodings: its input, weight and output."""
    norm.meta[ANNOTATION] = QuantizationAnnotation({norm.args[0]: fixed_spec(enc.x), norm.args[2]: fixed_spec(enc.weight)},
                                                   fixed_spec(enc.out), _annotated=True)


def linear_inputs(rows: Tensor, shape: NormRegionShape, enc: NormEncodings, spec: RegionSpec) -> dict[int, Tensor]:
    """Per linear, what its INT8 product reads from ``rows`` (the region's input, on its grid): the
    16-bit normed rows on its group's INT8 grid. Split channels and second encodings are chosen on these."""
    return spec.linear_reads(npu_rms_norm(rows, shape.weight, shape.eps, enc))


def region_peaks(shape: NormRegionShape, enc: NormEncodings, names: list[str], linears: list[nn.Linear],
                 plans: dict) -> dict[int, Peak]:
    """Linear index -> its ``Peak`` for the linears whose peak product ``shape`` holds."""
    return {i: peak_grids(linears[i].weight, plans[n].peak, plans[n].clip, enc.out, shape.weight)
            for i, n in enumerate(names) if n in shape.peaks}


def quantized_norm_region(shape: NormRegionShape, enc: NormEncodings, linears: list[nn.Linear], spec: RegionSpec,
                          plans: dict, granularity: str, calib_rows: Tensor, rows_per_call: int,
                          peaks: dict[int, Peak] | None = None):
    """The region exported for ``rows_per_call`` rows, annotated (the norm, the inputs and the peak
    products (``region_peaks``, the linears of ``spec.peaks``) fixed, the linears' output encodings
    observed on every block of ``calib_rows``, which lie on the norm's input grid), converted (pt2e).
    Returns (graph, example inputs)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    if calib_rows.shape[0] % rows_per_call:
        raise LlmNpuError(f"{calib_rows.shape[0]} calibration rows are not a whole number of {rows_per_call}-row calls")
    peaks = peaks or {}
    if sorted(peaks) != spec.peaks:
        raise LlmNpuError(f"{spec.method}: peak products of linears {sorted(peaks)}, its spec names {spec.peaks}")
    module = NormRegion(shape.weight, shape.eps, linears, spec, bool(shape.others), peaks).eval()
    example = (calib_rows[:rows_per_call],)
    graph = torch.export.export(module, example, strict=False).module()
    local = {REGION + k: v for k, v in plan_names(spec, plans).items()}
    ours = LlmNpuQuantizer(local, granularity, flavour="qnn",
                           fixed_outputs={REGION + k: v for k, v in fixed_outputs(spec, "qnn").items()})
    annotation = NormRegionAnnotation(enc, spec.scales, [peaks[i] for i in spec.peaks])
    prepared = prepare_pt2e(graph, backends.get("qnn").quantizer(ours, annotation))
    with torch.no_grad():
        for block in calib_rows.split(rows_per_call):
            prepared(block)
    return convert_pt2e(prepared), example


def convert_norm_region(shape: NormRegionShape, enc: NormEncodings, linears: list[nn.Linear], spec: RegionSpec,
                        plans: dict, granularity: str, calib_rows: Tensor, rows_per_call: int,
                        peaks: dict[int, Peak] | None = None):
    """The region ready to lower to HTP; returns (``Converted``, the encodings of RegionModule's outputs,
    as ``npu_subgraphs.output_encodings`` gives a linears-only region's)."""
    graph, example = quantized_norm_region(shape, enc, linears, spec, plans, granularity, calib_rows, rows_per_call,
                                           peaks)
    encodings = output_encodings(graph)[len(shape.others):len(shape.others) + spec.outputs - len(spec.peaks)]
    return Converted(spec, graph, example), encodings


def lower_norm_region(shape: NormRegionShape, enc: NormEncodings, linears: list[nn.Linear], spec: RegionSpec,
                      plans: dict, granularity: str, calib_rows: Tensor, rows_per_call: int, soc: str | None,
                      peaks: dict[int, Peak] | None = None):
    """The region lowered alone to one HTP context binary; returns (edge program manager, its encodings)."""
    converted, encodings = convert_norm_region(shape, enc, linears, spec, plans, granularity, calib_rows,
                                               rows_per_call, peaks)
    return lower_converted([converted], "qnn", soc), encodings
