"""Check lowered NPU subgraphs against our cpu-int8 engine on real input.

One chunk goes through the engine's subgraphs in order; each NPU subgraph's input rows and outputs
are kept. The same rows then run through the lowered methods (on this host: Qualcomm's HTP
simulator), and each output is compared with the engine's in units of the method's output
quantization step, plus its SQNR. The output encodings are observed on a chunk of calibration
text, the comparison uses a chunk of evaluation text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import LlmNpuError
from .qnn import DEFAULT_SOC, lower_regions, region_spec


@dataclass
class RegionIO:
    step: int
    layer: int | None
    names: list[str]
    rows: Tensor                 # [C, in_features] the region's input
    outputs: list[Tensor]        # the engine's outputs, one per linear, [C, out_features]


def capture_npu_io(engine, ids: Tensor) -> list[RegionIO]:
    """Run the first chunk of ``ids`` through ``engine``'s subgraphs in order; keep every NPU subgraph's I/O."""
    program = engine.program
    values = dict(engine.feeds(engine.check_prompt(ids))[0])
    captured = []
    with torch.inference_mode():
        for i, step in enumerate(program.steps):
            inputs = [values[n] for n in step.sub.inputs]
            outs = step.fn(*inputs)
            values.update(zip(step.sub.outputs, outs))
            if step.sub.kind == "npu":
                # copies now: a later CPU subgraph may work in place on an NPU output (the gated MLP)
                captured.append(RegionIO(i, step.sub.layer, list(step.sub.linears), inputs[0].clone(),
                                         [o.clone() for o in outs]))
    # ordinary tensors (not inference-mode ones), as rows: pt2e calibration and export need them
    for r in captured:
        r.rows = r.rows.reshape(-1, r.rows.shape[-1]).clone()
        r.outputs = [o.reshape(-1, o.shape[-1]).clone() for o in r.outputs]
    return captured


def sqnr_db(x: Tensor, ref: Tensor) -> float:
    noise = (x - ref).double().pow(2).sum()
    return float("inf") if noise == 0 else float(10 * torch.log10(ref.double().pow(2).sum() / noise))


def _output_scales(graph) -> dict[int, float]:
    """Output index -> scale of the quantize node that encodes it (the region's output encoding)."""
    out = next(n for n in graph.graph.nodes if n.op == "output")
    scales = {}
    for i, node in enumerate(out.args[0]):
        # dequantize(quantize(linear)) -> the quantize node's scale
        q = node.args[0] if node.op == "call_function" else None
        if q is not None and "quantize_per_tensor" in str(q.target):
            scales[i] = float(q.args[1])
    return scales


def validate_qnn(engine, calib_ids: Tensor, eval_ids: Tensor, soc: str = DEFAULT_SOC, layers: int | None = None,
                 progress: bool = True) -> dict:
    """Lower the engine's NPU subgraphs (of the first ``layers`` blocks) to QNN methods, run them on the
    simulator with the engine's own inputs, and compare (per subgraph: max steps, SQNR)."""
    from executorch.extension.pybindings.portable_lib import (
        _load_for_executorch_from_buffer,
    )

    if engine.plans is None:
        raise LlmNpuError("validation compares INT8 subgraphs: prepare the engine with a quantized mode")
    calib = capture_npu_io(engine, calib_ids)
    check = capture_npu_io(engine, eval_ids)
    keep = [i for i, r in enumerate(check) if layers is None or (r.layer is not None and r.layer < layers)]
    if not keep:
        raise LlmNpuError(f"no NPU subgraph in the first {layers} layers")
    regions, rows = [], {}
    for i in keep:
        spec = region_spec(f"npu_{check[i].step}", check[i].names, engine.plans)
        regions.append((spec, [engine.backend._linear(n) for n in spec.names]))
        rows[spec.method] = calib[i].rows
    program, graphs = lower_regions(regions, engine.plans, engine.backend.weights, rows, soc, progress)
    buffer = program.to_executorch().buffer
    runtime = _load_for_executorch_from_buffer(buffer)
    report = []
    for (spec, _), i in zip(regions, keep):
        got = runtime.run_method(spec.method, spec.inputs(check[i].rows))
        scales = _output_scales(graphs[spec.method])
        for j, (name, want) in enumerate(zip(spec.names, check[i].outputs)):
            out = got[j].reshape(want.shape)
            steps = (out - want).abs() / scales[j]
            report.append({"subgraph": check[i].step, "linear": name, "max_steps": round(float(steps.max()), 2),
                           "within_2_steps": round(float((steps <= 2).float().mean()), 5),
                           "sqnr_db": round(sqnr_db(out, want), 1)})
    return {"soc": soc, "pte_bytes": len(buffer), "methods": len(regions), "linears": report}
