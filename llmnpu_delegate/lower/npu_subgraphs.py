"""The partition's NPU subgraphs as quantized programs with our encodings, one method each.

A static NPU subgraph (the linears that share one input) becomes a method: float input rows
[C, in_features] in, one float output per linear out, integer work in between. Its input and
weight encodings are ours (``encodings.py``): the plan's static activation scale, our symmetric
INT8 weights. Linears of one subgraph whose activation scales differ (a pruned layer beside a
shadowed one) get one method input each: QNN keeps one encoding per tensor. Only the outputs'
encodings are observed, on calibration rows. Output channels of outsized range come out on their
own, in groups with their own encodings (``output_groups``), and an output that one 8-bit encoding
holds poorly comes out a second time with a finer one (``fine_outputs``); ``RegionSpec.merge`` puts
them back together.

The linears that write the residual stream (o_proj, down_proj) may come out at 16 bits instead
(``ExportConfig.residual_bits``, ``residual_writers``): their output error is added into every later
block's input, where 8 bits cost the most perplexity. They take their input at 16 bits too (HTP
refuses 8 in and 16 out), on a grid that holds the INT8 grid's values exactly
(``encodings.wide_activation_spec``), so the product is the same; the matrix unit runs them at its
16-bit rate. They need no second encoding.

Or the outputs stay float (``output_bits=32``, ``FloatOutputRegion``): the same integer product,
dequantized as our engine does, with no output encoding to observe or to saturate.

The target is an NPU backend (``backends/``): its quantizer takes our encodings, and it lowers the
converted graph to one delegate call (``qnn``: an HTP context binary per method; ``cpu-int8``:
XNNPACK's INT8 kernels, the same artefact without Qualcomm libraries).
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .. import backends
from ..errors import LlmNpuError
from ..families import writes_residual
from ..format.npu_io import FineOutput, RegionSpec, part_channels
from ..partitioner.regions import linear_names
from ..quantize.apply import LinearPlan
from ..quantize.sqnr import sqnr_db
from .encodings import LlmNpuQuantizer
from .xnnpack_forms import int8_weights_as_rows, mark_as_rows



# Output channels are peeled off a linear's output, largest range first, while the largest left
# exceeds BULK x the median channel's BULK_QUANTILE |value|; each peel takes the channels within WIDTH
# of its largest and becomes an output of its own, with its own encoding. At most MAX_GROUPS peels per
# linear. The bulk is measured by a quantile, not a maximum: an ordinary channel's maximum grows with
# the calibration's rows (three chunks: the chunk length sets them), its quantile does not, and a
# split that comes and goes with the chunk length changed the step of the rest up to 4x.
BULK = 12.0
BULK_QUANTILE = 0.99
WIDTH = 4.0
MAX_GROUPS = 8

# An 8-bit output (main or split group) whose one encoding, min/max over the calibration rows, holds
# the bulk of them (inside their FINE_QUANTILE range) below FINE_BELOW_DB comes out a second time
# with an encoding over that range (``fine_outputs``).
FINE_BELOW_DB = 25.0
FINE_QUANTILE = 0.99

# Columns a float-output region appends to its input rows: -128 s and 127 s (see FloatOutputRegion).
SENTINELS = 2


def output_groups(linear: nn.Linear, rows: Tensor) -> list[list[int]]:
    """Groups of output channels of ``linear`` (on ``rows``) whose range dwarfs the bulk's.

    An integer NPU graph requantizes each output to 8 bits with one scale per tensor. The embedded
    model's residual stream carries a few channels of ~25,000 against a median channel of ~50: one
    scale sized for those rounds every ordinary value of the layer to zero. Channels of similar range
    share an output (and its encoding) of their own; the runner puts them back in place.
    """
    with torch.no_grad():
        out = F.linear(rows, linear.weight, linear.bias).abs()
    span = out.amax(0)
    # kthvalue, not torch.quantile: no limit on the number of elements
    typical = out.kthvalue(max(1, math.ceil(BULK_QUANTILE * out.shape[0])), dim=0).values
    bulk = BULK * float(typical.median())
    rest = span.argsort(descending=True)
    groups: list[list[int]] = []
    while len(groups) < MAX_GROUPS and float(span[rest[0]]) > bulk:
        take = int((span[rest] > span[rest[0]] / WIDTH).sum())
        groups.append(sorted(rest[:take].tolist()))
        rest = rest[take:]
    return groups


def fine_outputs(linear: nn.Linear, rows: Tensor, splits: list[list[int]], flavour: str) -> list[tuple[int, tuple]]:
    """The parts of ``linear``'s output (``part_channels``) that get a second, finer 8-bit encoding,
    each with that encoding, (scale, zero point).

    A part qualifies when its one min/max encoding holds the bulk of its calibration values, those
    inside their FINE_QUANTILE range, below FINE_BELOW_DB: the few largest values set a step that
    rounds the ordinary ones away. (The SQNR of all values would not see it: the largest ones carry
    its energy. The embedded model: channels of ~25,000 on a sequence's first token and +-60 after
    it.) The fine encoding spans that bulk range."""
    with torch.no_grad():
        out = F.linear(rows, linear.weight, linear.bias)
    chosen = []
    for part in range(len(splits) + 1):
        values = out[:, part_channels(linear.out_features, splits, part)].flatten().double()
        one = encoding_for(float(values.min()), float(values.max()), flavour)
        sample = values[:: -(-values.numel() // (1 << 24))]     # torch.quantile's limit
        low, high = (float(q) for q in torch.quantile(sample, torch.tensor([1 - FINE_QUANTILE, FINE_QUANTILE],
                                                                             dtype=values.dtype)))
        bulk = values[(values >= low) & (values <= high)]
        if sqnr_db(_fake_quant(bulk, *one, flavour), bulk) < FINE_BELOW_DB:
            chosen.append((part, encoding_for(low, high, flavour)))
    return chosen


def residual_writers(names) -> frozenset[str]:
    """The linears of ``names`` (full names) that write the residual stream."""
    return frozenset(n for n in names if writes_residual(n))


def wide_locals(spec: RegionSpec, wide: frozenset[str]) -> frozenset[str]:
    """RegionModule's linears (``plan_names``) that compute a linear of ``wide``: its main output and
    its split channel groups."""
    parts = [i for i in sorted(spec.splits) for _ in spec.splits[i]]
    return frozenset([f"lins.{i}" for i, n in enumerate(spec.names) if n in wide]
                     + [f"outs.{j}" for j, i in enumerate(parts) if spec.names[i] in wide])


def _qrange(flavour: str) -> tuple[int, int]:
    return (0, 255) if flavour == "qnn" else (-128, 127)


def encoding_for(low: float, high: float, flavour: str) -> tuple[float, int]:
    """(scale, zero point) of an 8-bit affine encoding of [low, high] (widened to hold 0), as
    torch's min/max observer makes it."""
    qmin, qmax = _qrange(flavour)
    low, high = min(low, 0.0), max(high, 0.0)
    scale = max((high - low) / (qmax - qmin), torch.finfo(torch.float32).eps)
    return scale, int(min(max(qmin - round(low / scale), qmin), qmax))


def _fake_quant(x: Tensor, scale: float, zero: int, flavour: str) -> Tensor:
    qmin, qmax = _qrange(flavour)
    return (torch.clamp(torch.round(x / scale) + zero, qmin, qmax) - zero) * scale


class RegionModule(nn.Module):
    """One NPU subgraph as a module: ``inputs[g]`` feeds the linears of activation-scale group ``g``.
    Outputs: each linear without its split channels, then each split channel group (``spec.splits``),
    then the outputs computed a second time for their fine encoding (``spec.fine``)."""

    def __init__(self, linears: list[nn.Linear], groups: list[list[int]], splits: dict[int, list[list[int]]],
                 fine: list[FineOutput] = ()):
        super().__init__()
        mains, parts, self.part_of = [], [], []
        for i, lin in enumerate(linears):
            split = {c for chans in splits.get(i, []) for c in chans}
            mains.append(_rows(lin, [c for c in range(lin.out_features) if c not in split]) if split else lin)
            for chans in splits.get(i, []):
                parts.append(_rows(lin, chans))
                self.part_of.append(i)
        self.lins, self.outs = nn.ModuleList(mains), nn.ModuleList(parts)
        # a copy of the part's weight rows: one linear node per output encoding
        self.twins = nn.ModuleList(_rows(linears[f.linear], part_channels(linears[f.linear].out_features,
                                                                          splits.get(f.linear, []), f.part))
                                   for f in fine)
        self.twin_of = [f.linear for f in fine]
        self.groups = groups

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        source = {}
        for x, idx in zip(inputs, self.groups):
            for i in idx:
                source[i] = x
        return (tuple(self.lins[i](source[i]) for i in range(len(self.lins)))
                + tuple(out(source[i]) for out, i in zip(self.outs, self.part_of))
                + tuple(twin(source[i]) for twin, i in zip(self.twins, self.twin_of)))


class FloatOutputRegion(nn.Module):
    """One NPU subgraph with float outputs, as XNNPACK's dynamic INT8 linears compute them.

    Those quantize each input row with a scale and zero point of its own range, (max - min) / 255,
    and dequantize the int32 accumulator to float. Each group's rows are clamped to its INT8 grid
    (what the static quantization does; the runners hand over rows already on it) and get two
    sentinel columns, -128 s and 127 s, whose weights are zero: every row's range is then exactly
    255 s, so the dynamic scale is the plan's ``s``, the zero point 0, and the GEMM takes the codes
    of our static quantization. The product is our engine's, to float rounding (tested). The
    decode step pads the same linears with two zero columns (``decode_method.pad_linears``), so the two
    methods' INT8 weights are the same bytes, stored and packed once."""

    def __init__(self, linears: list[nn.Linear], groups: list[list[int]], scales: list[float], rows: int):
        super().__init__()
        self.lins = nn.ModuleList(_padded(lin) for lin in linears)
        self.groups, self.scales = groups, scales
        for g, s in enumerate(scales):
            self.register_buffer(f"sentinel{g}", torch.tensor([[-128.0 * s, 127.0 * s]]).expand(rows, SENTINELS).contiguous())

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        source = {}
        for g, (x, idx, s) in enumerate(zip(inputs, self.groups, self.scales)):
            rows = torch.cat([x.clamp(-127.0 * s, 127.0 * s), getattr(self, f"sentinel{g}")], -1)
            for i in idx:
                source[i] = rows
        return tuple(lin(source[i]) for i, lin in enumerate(self.lins))


def _padded(lin: nn.Linear) -> nn.Linear:
    """``lin`` with SENTINELS zero input columns appended (per-row weight scales unchanged)."""
    out = nn.Linear(lin.in_features + SENTINELS, lin.out_features, bias=lin.bias is not None)
    with torch.no_grad():
        out.weight.copy_(pad_columns(lin.weight))
        if lin.bias is not None:
            out.bias.copy_(lin.bias)
    return out


def pad_columns(weight: Tensor) -> Tensor:
    return F.pad(weight.detach(), (0, SENTINELS))


def _rows(lin: nn.Linear, channels: list[int]) -> nn.Linear:
    """A linear computing only ``channels`` of ``lin``'s outputs (same per-row weights, so the same
    per-channel INT8 weights and scales)."""
    sub = nn.Linear(lin.in_features, len(channels), bias=lin.bias is not None)
    with torch.no_grad():
        sub.weight.copy_(lin.weight[channels])
        if lin.bias is not None:
            sub.bias.copy_(lin.bias[channels])
    return sub


def region_spec(method: str, names: list[str], plans: dict[str, LinearPlan],
                splits: dict[int, list[list[int]]] | None = None,
                fine: dict[int, list[tuple[int, tuple]]] | None = None, flavour: str = "qnn") -> RegionSpec:
    """``fine``: per linear, the parts with a second encoding, (part, (scale, zero point)) as
    ``fine_outputs`` gives them for ``flavour``'s 8-bit range."""
    by_scale: dict[float, list[int]] = {}
    for i, n in enumerate(names):
        by_scale.setdefault(float(plans[n].act_scale), []).append(i)
    qmin, qmax = _qrange(flavour)
    twins = [FineOutput(i, part, scale, (qmin - zero) * scale, (qmax - zero) * scale)
             for i in sorted(fine or {}) for part, (scale, zero) in fine[i]]
    return RegionSpec(method, list(names), list(by_scale.values()), list(by_scale),
                      {i: c for i, c in (splits or {}).items() if c}, twins)


def plan_names(spec: RegionSpec, plans: dict[str, LinearPlan]) -> dict[str, LinearPlan]:
    """RegionModule's linears (``lins.<i>``, ``outs.<j>``, ``twins.<k>``) -> the plan entries of the
    linears they compute."""
    local = {f"lins.{i}": plans[n] for i, n in enumerate(spec.names)}
    parts = [i for i in sorted(spec.splits) for _ in spec.splits[i]]
    local.update({f"outs.{j}": plans[spec.names[i]] for j, i in enumerate(parts)})
    local.update({f"twins.{k}": plans[spec.names[f.linear]] for k, f in enumerate(spec.fine)})
    return local


def fixed_outputs(spec: RegionSpec, flavour: str) -> dict[str, tuple[float, int]]:
    """RegionModule's twin linears -> their fine output encodings (scale, zero point)."""
    qmin = _qrange(flavour)[0]
    return {f"twins.{k}": (f.scale, qmin - round(f.low / f.scale)) for k, f in enumerate(spec.fine)}


def quantized_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan], granularity: str,
                     calib_rows: Tensor, target: str = "qnn", rows_per_call: int | None = None, output_bits: int = 8,
                     wide: frozenset[str] = frozenset()):
    """The region exported for ``rows_per_call`` rows (default: all of ``calib_rows``), annotated with
    our encodings (the linears of ``wide`` at 16 bits), its output encodings (``output_bits=8``)
    observed on every block of ``calib_rows``, converted (pt2e). Returns (graph, example inputs)."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    backend = backends.get(target)
    check_output_bits(output_bits, target)
    n = rows_per_call or calib_rows.shape[0]
    if calib_rows.shape[0] % n:
        raise LlmNpuError(f"{calib_rows.shape[0]} calibration rows are not a whole number of {n}-row calls")
    if output_bits == 32:
        if spec.splits or spec.fine:
            raise LlmNpuError(f"{spec.method}: float outputs need no split channels or second encodings")
        module = FloatOutputRegion(linears, spec.groups, spec.scales, n).eval()
    else:
        module = RegionModule(linears, spec.groups, spec.splits, spec.fine).eval()
    example = spec.inputs(calib_rows[:n])
    # non-strict: the region is plain tensor code, so Dynamo's bytecode tracing adds nothing but time
    # (the emitted methods are the same bytes; 14 % of an NPU method's lowering)
    graph = torch.export.export(module, example, strict=False).module()
    local = plan_names(spec, plans)
    mark_as_rows(node for node, name in linear_names(graph, local).items() if local[name].shadow)
    ours = LlmNpuQuantizer(local, granularity, flavour=backend.encodings, output_bits=output_bits,
                           fixed_outputs=fixed_outputs(spec, backend.encodings), wide=wide_locals(spec, wide))
    prepared = prepare_pt2e(graph, backend.quantizer(ours))
    with torch.no_grad():
        for block in calib_rows.split(n):
            prepared(*spec.inputs(block))
    converted = convert_pt2e(prepared)
    if output_bits == 32:
        int8_weights_as_rows(converted)     # the shadowed ones, as the decode stores them (``decode_method.export_decode``)
    return converted, example


def check_output_bits(output_bits: int, target: str) -> None:
    offered = backends.get(target).output_bits
    if output_bits not in offered:
        raise LlmNpuError(f"backend {target} gives its NPU methods {' or '.join(map(str, offered))}-bit outputs, "
                          f"not {output_bits}: use --output-bits {offered[0]}")


@dataclass(frozen=True)
class OutputEncoding:
    scale: float
    low: float         # the smallest and largest values the output can represent
    high: float
    bits: int = 8


def output_encodings(graph, skip: int = 0) -> list[OutputEncoding | None]:
    """Per output of a converted region (RegionModule's order) after its first ``skip`` ones: the
    encoding of its quantize node (None for a float output)."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    encodings = []
    for node in out.args[0][skip:]:
        if node.op == "call_function" and node.target in (torch.ops.aten.linear.default, torch.ops.aten.addmm.default):
            encodings.append(None)
            continue
        q = node.args[0] if node.op == "call_function" else None    # dequantize(quantize(linear))
        if q is None or "quantize_per_tensor" not in str(q.target):
            raise LlmNpuError(f"region output {node.name} is not quantized")
        scale, zero, qmin, qmax = float(q.args[1]), int(q.args[2]), int(q.args[3]), int(q.args[4])
        encodings.append(OutputEncoding(scale, (qmin - zero) * scale, (qmax - zero) * scale,
                                        (qmax - qmin).bit_length()))
    return encodings


@dataclass
class Converted:
    """An NPU method ready to lower: its converted (pt2e) graph, example inputs, and the spec that
    names it and its linears."""
    spec: RegionSpec
    graph: object
    example: tuple


def convert_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan], granularity: str,
                   calib_rows: Tensor, rows_per_call: int, target: str, output_bits: int = 8,
                   wide: frozenset[str] = frozenset()):
    """One NPU subgraph quantized for ``target`` (``rows_per_call`` rows a call; output encodings from
    ``calib_rows``; the linears of ``wide`` at 16 bits); returns (``Converted``, its output encodings:
    None for float ones)."""
    graph, example = quantized_region(spec, linears, plans, granularity, calib_rows, target, rows_per_call,
                                      output_bits, wide)
    return Converted(spec, graph, example), output_encodings(graph)


def lower_converted(converted: list[Converted], target: str, soc: str | None = None):
    """``converted`` lowered for ``target`` in one call, a method each (on a backend that
    ``shares_contexts``, their graphs in one context); returns the edge program manager."""
    edge = backends.get(target).lower({c.spec.method: (c.graph, c.example) for c in converted}, soc)
    for c in converted:
        check_delegated(edge, c.spec, target)
    return edge


def lower_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan], granularity: str,
                 calib_rows: Tensor, rows_per_call: int, target: str, soc: str | None = None, output_bits: int = 8):
    """One NPU subgraph lowered alone (``convert_region``, ``lower_converted``); returns (edge program
    manager, its output encodings)."""
    converted, encodings = convert_region(spec, linears, plans, granularity, calib_rows, rows_per_call, target,
                                          output_bits)
    return lower_converted([converted], target, soc), encodings


def check_delegated(edge, spec: RegionSpec, target: str) -> None:
    """An NPU method must be one delegate call: anything left outside would run on the CPU, in float."""
    left = [str(n.target) for n in edge.exported_program(spec.method).graph.nodes
            if n.op == "call_function" and "executorch_call_delegate" not in str(n.target)
            and n.target is not operator.getitem]
    if left:
        raise LlmNpuError(f"{target} did not take all of NPU subgraph {spec.method} ({', '.join(spec.names)}): "
                          f"{', '.join(sorted(set(left)))} would stay outside the delegate")
