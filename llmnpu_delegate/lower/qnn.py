"""NPU subgraphs through ExecuTorch's Qualcomm (QNN/HTP) delegate, with our encodings.

Each static NPU subgraph of a partition (the linears that share one input) becomes one method of a
``.pte``: float input rows [C, in_features] in, one float output per linear out, the HTP context
binary in between. Its input and weight encodings are ours (``encodings.py``): the plan's static
activation scale, our symmetric INT8 weight scales. Linears of one region whose activation scales
differ (a pruned layer beside a shadowed one) get one method input each: QNN keeps one encoding per
tensor. Only the outputs' encodings are observed, on calibration rows.

Import this module only after ``qnn.sdk.activate()`` (``lower_regions`` does it): ExecuTorch's
Qualcomm package looks for the SDK when it is imported.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from ..errors import LlmNpuError
from ..quantize.apply import LinearPlan

DEFAULT_SOC = "SM8650"     # Snapdragon 8 Gen 3, the paper's device


def _quiet_qualcomm_logs() -> None:
    # The Qualcomm package sets its own loggers to DEBUG (a line per op and pass).
    import logging

    for name in list(logging.root.manager.loggerDict):
        if name.startswith("executorch.backends.qualcomm"):
            logging.getLogger(name).setLevel(logging.WARNING)


def chipsets() -> dict:
    from ..qnn.sdk import activate

    activate()
    from executorch.backends.qualcomm.utils.utils import get_soc_to_chipset_map

    return get_soc_to_chipset_map()


def check_soc(soc: str):
    table = chipsets()
    if soc not in table:
        raise LlmNpuError(f"unknown SoC '{soc}': use one of {', '.join(sorted(table))}")
    return table[soc]


class RegionModule(nn.Module):
    """One NPU subgraph as a module: ``inputs[g]`` feeds the linears of activation-scale group ``g``."""

    def __init__(self, linears: list[nn.Linear], groups: list[list[int]]):
        super().__init__()
        self.lins = nn.ModuleList(linears)
        self.groups = groups

    def forward(self, *inputs: Tensor) -> tuple[Tensor, ...]:
        outs: list[Tensor | None] = [None] * len(self.lins)
        for x, idx in zip(inputs, self.groups):
            for i in idx:
                outs[i] = self.lins[i](x)
        return tuple(outs)


@dataclass
class RegionSpec:
    method: str                       # method name in the .pte
    names: list[str]                  # linear names, in output order
    groups: list[list[int]]           # activation-scale groups: indices into names
    scales: list[float]               # one activation scale per group

    def inputs(self, x: Tensor) -> tuple[Tensor, ...]:
        return (x, *(x.clone() for _ in self.groups[1:]))


def region_spec(method: str, names: list[str], plans: dict[str, LinearPlan]) -> RegionSpec:
    by_scale: dict[float, list[int]] = {}
    for i, n in enumerate(names):
        by_scale.setdefault(float(plans[n].act_scale), []).append(i)
    return RegionSpec(method, list(names), list(by_scale.values()), list(by_scale))


def _quantized_region(spec: RegionSpec, linears: list[nn.Linear], plans: dict[str, LinearPlan],
                      granularity: str, calib_rows: Tensor):
    from executorch.backends.qualcomm.quantizer.quantizer import QnnQuantizer
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from .encodings import LlmNpuQuantizer

    module = RegionModule(linears, spec.groups).eval()
    example = spec.inputs(calib_rows)
    graph = torch.export.export(module, example, strict=True).module()
    # linears are named lins.<i> inside the module: map them to the plan's entries
    local = {f"lins.{i}": plans[n] for i, n in enumerate(spec.names)}
    ours = LlmNpuQuantizer(local, granularity, flavour="qnn")
    quantizer = QnnQuantizer()
    quantizer.add_custom_quant_annotations((ours.annotate,))
    prepared = prepare_pt2e(graph, quantizer)
    with torch.no_grad():
        prepared(*example)
    return convert_pt2e(prepared), example


def lower_regions(regions: list[tuple[RegionSpec, list[nn.Linear]]], plans: dict[str, LinearPlan],
                  granularity: str, calib_rows: dict[str, Tensor], soc: str = DEFAULT_SOC, progress: bool = True):
    """One ExecuTorch program with a QNN method per region; returns (program, quantized reference graphs)."""
    from ..qnn.sdk import activate

    activate()
    chipset = check_soc(soc)
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
        to_edge_transform_and_lower_to_qnn,
    )
    from tqdm.auto import tqdm

    _quiet_qualcomm_logs()
    graphs, examples = {}, {}
    for spec, linears in tqdm(regions, desc="quantizing NPU subgraphs", disable=not progress):
        graphs[spec.method], examples[spec.method] = _quantized_region(spec, linears, plans, granularity,
                                                                       calib_rows[spec.method])
    specs = generate_qnn_executorch_compiler_spec(soc_model=chipset,
                                                  backend_options=generate_htp_compiler_spec(use_fp16=False))
    program = to_edge_transform_and_lower_to_qnn(graphs, examples, {m: specs for m in graphs})
    return program, graphs
