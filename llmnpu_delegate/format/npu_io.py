"""An NPU method's inputs and outputs, as the program format lays them out.

An NPU subgraph's linears that share an activation scale share one method input (QNN keeps one
encoding per tensor); output channels of outsized range come out as extra outputs with their own
encodings (``lower/npu_subgraphs.output_groups``), and an output that one 8-bit encoding cannot hold
comes out twice, with a second, finer encoding (``FineOutput``). ``RegionSpec`` is what a runner needs
to call such a method: it puts each group's rows on its activation grid and merges the outputs back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..kernels import quantize


def part_channels(width: int, splits: list[list[int]], part: int) -> list[int]:
    """A linear's output channels in its output ``part``: 0 the main one (all but the split
    channels, ``splits``), j the j-th split group."""
    if part:
        return splits[part - 1]
    split = {c for chans in splits for c in chans}
    return [c for c in range(width) if c not in split]


@dataclass(frozen=True)
class FineOutput:
    """A second 8-bit encoding of one of a method's outputs, over the range that holds most of its
    values (a calibration quantile): the method computes that product twice and requantizes it once
    with the full range (coarse) and once with this one. Where the fine value is inside its range it
    is the better one; where it saturated the coarse one is right. Two 8-bit encodings of one
    product: an integer NPU that gives 8-bit inputs only 8-bit outputs (HTP) gets a range that holds
    a value of 25,000 and values of +-60 at a step under one."""
    linear: int        # index into RegionSpec.names
    part: int          # 0: the linear's main output; j: its j-th split channel group
    scale: float
    low: float         # the smallest and largest value the encoding represents
    high: float

    def take(self, coarse: Tensor, fine: Tensor) -> Tensor:
        # half a step inside the ends: a fine value at either end may have saturated
        inside = (fine > self.low + 0.5 * self.scale) & (fine < self.high - 0.5 * self.scale)
        return torch.where(inside, fine, coarse)


@dataclass
class RegionSpec:
    method: str                       # method name in the .pte
    names: list[str]                  # linear names, in output order
    groups: list[list[int]]           # activation-scale groups: indices into names
    scales: list[float]               # one activation scale per group
    # linear index -> its split output channel groups (each an extra method output, in index order)
    splits: dict[int, list[list[int]]] = field(default_factory=dict)
    # second encodings of some outputs: extra method outputs after the split groups, in this order
    fine: list[FineOutput] = field(default_factory=list)
    # linears whose shadow product over their peak channels the method computes too (placement
    # piece ``peak``, ``lower/norm_region.py``): one more output each, last, added on merge
    peaks: list[int] = field(default_factory=list)

    def inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        # distinct buffers: the runtime aliases one tensor object passed to two inputs
        return (x, *(x.clone() for _ in self.groups[1:]))

    def grid_inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        """What the CPU side hands the method: each group's rows already on its activation grid,
        ``clamp(round(x / scale), +-127) * scale``, the codes of our ``quantize``. HTP's own float ->
        int8 conversion of raw rows disagrees with that rounding by a code now and then (up to 3
        output steps on the embedded model's v_proj); values on the grid convert exactly."""
        if len(self.scales) != len(self.groups):
            raise LlmNpuError(f"{self.method}: one activation scale per input group is needed")
        return tuple(quantize(x, s).to(x.dtype).mul_(s) for s in self.scales)

    def linear_reads(self, x: Tensor) -> dict[int, Tensor]:
        """Per linear (index into ``names``), the rows its INT8 product reads: ``x`` on its group's
        grid (``grid_inputs``). Split channels and second encodings are chosen on these."""
        grids = self.grid_inputs(x)
        return {i: grids[g] for g, group in enumerate(self.groups) for i in group}

    def output_index(self, linear: int, part: int) -> int:
        """Where the method returns ``linear``'s output ``part`` (0: main, j: j-th split group)."""
        if part == 0:
            return linear
        groups = self.splits.get(linear, [])
        if not 0 < part <= len(groups):
            raise LlmNpuError(f"{self.method}: {self.names[linear]} has no split channel group {part}")
        return len(self.names) + sum(len(self.splits[i]) for i in self.splits if i < linear) + part - 1

    @property
    def outputs(self) -> int:
        """How many outputs the method's linears return: mains, split groups, second encodings, peak
        products."""
        return len(self.names) + sum(len(g) for g in self.splits.values()) + len(self.fine) + len(self.peaks)

    def merge(self, outs: tuple[Tensor, ...]) -> list[Tensor]:
        """The method's outputs back to one tensor per linear, channels in their places."""
        n = len(self.names)
        coarse = self.outputs - len(self.fine) - len(self.peaks)
        if len(outs) != self.outputs:
            raise LlmNpuError(f"{self.method} returned {len(outs)} outputs, its spec names {self.outputs}")
        outs, fine, peaks = list(outs[:coarse]), outs[coarse:coarse + len(self.fine)], outs[coarse + len(self.fine):]
        for f, values in zip(self.fine, fine):
            k = self.output_index(f.linear, f.part)
            outs[k] = f.take(outs[k], values)
        merged, k = list(outs[:n]), n
        for i in sorted(self.splits):
            groups = self.splits[i]
            parts = [merged[i], *outs[k:k + len(groups)]]
            k += len(groups)
            split = [c for chans in groups for c in chans]
            width = sum(p.shape[-1] for p in parts)
            keep = [c for c in range(width) if c not in set(split)]
            merged[i] = torch.cat(parts, -1).index_select(-1, torch.tensor(keep + split).argsort())
        for i, product in zip(self.peaks, peaks):
            merged[i] = merged[i] + product
        return merged


def window_inputs(names: list[str], args: list, past: tuple[str, str], mask: str, window: int, mask_value: float,
                  heads: int) -> tuple[Tensor, ...]:
    """An attention region's method inputs (``lower/attention_region.py``) from the chunk step's
    (``args``, by the subgraph's input ``names``): the past K/V [1, KVH, P, d] padded with zeros to
    ``window - C`` rows; the boolean mask [.., C, P + C] made additive over the window, [1, G*C,
    window] (``mask_value`` where a query may not look: every empty slot too; repeated for the G
    query heads of each K/V head); every input contiguous."""
    values = dict(zip(names, args))
    chunk = values[mask].shape[-2]
    p = values[past[0]].shape[2]
    if p + chunk > window:
        raise LlmNpuError(f"a past of {p} tokens and a chunk of {chunk} pass the program's attention window of "
                          f"{window}: prompt with fewer tokens")
    out = []
    for name in names:
        a = values[name]
        if name in past:
            a = torch.cat([a, a.new_zeros(a.shape[0], a.shape[1], window - chunk - p, a.shape[3])], dim=2)
        elif name == mask:
            allowed = torch.zeros(chunk, window, dtype=torch.bool)
            m = a.reshape(chunk, p + chunk)
            allowed[:, :p] = m[:, :p]
            allowed[:, window - chunk:] = m[:, p:]
            kvh = values[past[0]].shape[1]
            a = torch.where(allowed, 0.0, mask_value).repeat(heads // kvh, 1)[None]
        out.append(a.contiguous())
    return tuple(out)
