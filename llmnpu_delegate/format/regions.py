"""An NPU method's inputs and outputs, as the program format lays them out.

An NPU subgraph's linears that share an activation scale share one method input (QNN keeps one
encoding per tensor); output channels of outsized range come out as extra outputs with their own
encodings (``lower/npu_subgraphs.output_groups``). ``RegionSpec`` is what a runner needs to call such
a method: it puts each group's rows on its activation grid and merges the split outputs back.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..kernels import quantize


@dataclass
class RegionSpec:
    method: str                       # method name in the .pte
    names: list[str]                  # linear names, in output order
    groups: list[list[int]]           # activation-scale groups: indices into names
    scales: list[float]               # one activation scale per group
    # linear index -> its split output channel groups (each an extra method output, in index order)
    splits: dict[int, list[list[int]]] = field(default_factory=dict)

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

    def merge(self, outs: tuple[Tensor, ...]) -> list[Tensor]:
        """The method's outputs back to one tensor per linear, channels in their places."""
        n = len(self.names)
        merged, k = list(outs[:n]), n
        for i in sorted(self.splits):
            groups = self.splits[i]
            parts = [merged[i], *outs[k:k + len(groups)]]
            k += len(groups)
            split = [c for chans in groups for c in chans]
            width = sum(p.shape[-1] for p in parts)
            keep = [c for c in range(width) if c not in set(split)]
            merged[i] = torch.cat(parts, -1).index_select(-1, torch.tensor(keep + split).argsort())
        return merged
