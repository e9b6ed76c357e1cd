"""Check an exported ``.pte`` against our cpu-int8 engine on real input.

Three checks, all against an engine prepared like the one that was exported (its placement too):

- **per NPU subgraph**: one chunk of evaluation text goes through the engine's subgraphs in order;
  each NPU subgraph's input rows go through its ``.pte`` method (on this host: Qualcomm's HTP
  simulator for ``qnn``), and each output is compared with the engine's in units of the method's
  output quantization step, plus its SQNR. Engine values beyond the range the output encoding
  represents (larger than anything in the calibration text) saturate: they are counted apart and
  left out of the largest difference. A float output's step is one unit of the int32 accumulator
  (activation scale x the channel's weight scale): both compute the same integer product;
- **per NPU graph** (a method holding more than linears, ``lower/graph_methods.py``): the engine's
  inputs of that subgraph through the method, each output's SQNR against the engine's; the linears
  of a QNN norm region (``lower/norm_region.py``) are compared in steps too, as above;
- **whole prefill**: a short prompt runs from the ``.pte`` alone (``PteRunner``, out-of-order
  executor) and from the engine: same next token, logits and K/V SQNR; and both logits against
  the float model's, which tells whether the .pte strays further from it than the engine does.

The output encodings were observed on calibration text at export, the comparison uses evaluation text.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..format.npu_io import part_channels
from ..format.sidecar import NORM_REGION
from ..kernels import QMAX
from ..kernels.npu_attention import Encoding
from ..lower.npu_graph import holds_more_than_linears
from ..quantize.sqnr import sqnr_db  # noqa: F401  (the benchmarks and tests take it from here too)
from .pte_runner import PteRunner


@dataclass
class RegionIO:
    step: int
    layer: int | None
    names: list[str]
    rows: Tensor                 # [C, in_features] the region's input
    outputs: list[Tensor]        # the engine's outputs, one per linear, [C, out_features]


def capture_npu_io(engine, ids: Tensor, graphs: list | None = None) -> list[RegionIO]:
    """Run the first chunk of ``ids`` through ``engine``'s subgraphs in order; keep every linears-only
    NPU subgraph's I/O, and (into ``graphs``, as (step, layer, inputs, outputs)) every other NPU one's."""
    program = engine.program
    ids = engine.check_prompt(ids[: engine.chunk_len])
    captured = []
    with torch.inference_mode():
        for _, i, inputs, outs in program.run_in_order(engine.feeds(ids)):
            sub = program.steps[i].sub
            if sub.kind == "npu" and holds_more_than_linears(sub):
                if graphs is not None:
                    graphs.append((i, sub.layer, inputs, [o.clone() for o in outs.values()]))
            elif sub.kind == "npu":
                # copies now: a later CPU subgraph may work in place on an NPU output (the gated MLP)
                captured.append(RegionIO(i, sub.layer, list(sub.linears), inputs[0].clone(),
                                         [o.clone() for o in outs.values()]))
    # ordinary tensors (not inference-mode ones), as rows
    for r in captured:
        r.rows = r.rows.reshape(-1, r.rows.shape[-1]).clone()
        r.outputs = [o.reshape(-1, o.shape[-1]).clone() for o in r.outputs]
    return captured


def output_encoding(linear: dict, width: int, weight: Tensor | None = None,
                    granularity: str = "channel") -> tuple[Tensor, Tensor, Tensor]:
    """Per output channel of a linear (split channels have their own): the encoding's step and the
    lowest and highest value it can represent (with its peak product's added, where it has one). A
    float output (``bits`` 32) represents everything; its step is the accumulator's (``weight``: the
    linear's float weight, whose INT8 scale is max |w| / 127 per channel or per tensor,
    ``granularity``)."""
    if linear["output"]["bits"] == 32:
        if weight is None:
            raise LlmNpuError("a float output's step needs the linear's weight")
        w = weight.detach().abs().float()
        step = linear["act_scale"] * (w.amax(1) if granularity == "channel" else w.amax().expand(width)) / QMAX
        return step, torch.full((width,), -float("inf")), torch.full((width,), float("inf"))
    step, low, high = (torch.full((width,), float(v)) for v in (linear["output"]["scale"], *linear["output"]["range"]))
    for chans, enc in zip(linear["split_channels"], linear["split_outputs"]):
        step[chans], low[chans], high[chans] = enc["scale"], enc["range"][0], enc["range"][1]
    if "peak" in linear:    # a product the runner adds reaches beyond the 8-bit parts' range
        peak = Encoding(**linear["peak"]["out"])
        low, high = low + peak.floor, high + peak.ceiling
    return step, low, high


def element_steps(linear: dict, want: Tensor, weight: Tensor | None = None,
                  granularity: str = "channel") -> tuple[Tensor, Tensor]:
    """Per element of the engine's output ``want`` [rows, width]: the step of the encoding that
    carries it (a part's fine second encoding where the value lies inside its range) and whether the
    output's encodings represent it."""
    width = want.shape[-1]
    step, low, high = output_encoding(linear, width, weight, granularity)
    step, inside = step.expand_as(want).clone(), (want >= low) & (want <= high)
    for f in linear.get("fine_outputs", []):
        chans = part_channels(width, linear["split_channels"], f["part"])
        # a full step inside the ends: the runner takes the fine value where it is half a step inside
        held = (want[:, chans] >= f["range"][0] + f["scale"]) & (want[:, chans] <= f["range"][1] - f["scale"])
        step[:, chans] = torch.where(held, torch.tensor(f["scale"]), step[:, chans])
    return step, inside


def check_engine_matches(engine, meta: dict) -> None:
    """The engine must be the exported one: same weights, chunk length and activation scales."""
    if engine.fingerprint != meta["model"]["fingerprint"] or engine.kv.layers != meta["model"]["layers"]:
        raise LlmNpuError("the engine's model is not the exported one (weights or number of blocks differ)")
    if engine.chunk_len != meta["chunk_len"]:
        raise LlmNpuError(f"the engine's chunk length is {engine.chunk_len}, the .pte's {meta['chunk_len']}")
    if engine.plans is None:
        raise LlmNpuError("validation compares INT8 subgraphs: prepare the engine with a quantized mode")
    for name, lin in meta["linears"].items():
        if name not in engine.plans or abs(engine.plans[name].act_scale - lin["act_scale"]) > 1e-9 * lin["act_scale"]:
            raise LlmNpuError(f"activation scale of {name} differs from the .pte's: it was exported with another "
                              "calibration or quantization config; export again")


def validate_pte(pte, engine, eval_ids: Tensor, prompt_ids: Tensor | None = None, runner=None) -> dict:
    """Compare ``pte``'s NPU methods and a whole prefill from it with ``engine`` (see module docstring)."""
    runner = runner or PteRunner(pte)
    meta = runner.meta
    check_engine_matches(engine, meta)
    steps = runner.program.steps
    report, graphs = [], []

    def compare(i: int, layer, name: str, out: Tensor, want: Tensor) -> None:
        out, want = out.reshape(-1, out.shape[-1]), want.reshape(-1, want.shape[-1])
        step, inside = element_steps(meta["linears"][name], want, engine.backend.linear(name).weight,
                                     engine.backend.weights)
        steps_off = (out - want).abs() / step
        # an engine value beyond what the output encoding can represent saturates: counted apart
        report.append({"subgraph": i, "layer": layer, "linear": name,
                       "output_bits": meta["linears"][name]["output"]["bits"],
                       "fine_outputs": len(meta["linears"][name]["fine_outputs"]),
                       "max_steps": round(float(steps_off[inside].max()), 2) if inside.any() else None,
                       "within_2_steps": round(float((steps_off <= 2).float().mean()), 5),
                       "saturated": round(float((~inside).float().mean()), 5),
                       "sqnr_db": round(sqnr_db(out, want), 1)})

    for io in capture_npu_io(engine, eval_ids, graphs):
        for name, out, want in zip(io.names, steps[io.step].fn(io.rows), io.outputs):
            compare(io.step, io.layer, name, out, want)
    methods = []
    for i, layer, inputs, want in graphs:
        with torch.inference_mode():
            got = steps[i].fn(*inputs)
        entry = meta["subgraphs"][i]
        if entry.get("form") == NORM_REGION:       # its linears' outputs are 8-bit ones: in steps too
            for name, output in zip(entry["linears"], entry["linear_outputs"]):
                k = entry["outputs"].index(output)
                compare(i, layer, name, got[k], want[k])
        methods.append({"subgraph": i, "layer": layer, "method": runner.meta["subgraphs"][i]["method"],
                        "outputs": len(want), "sqnr_db_min": round(min(sqnr_db(a, b) for a, b in zip(got, want)), 1)})
    prompt = engine.check_prompt(prompt_ids if prompt_ids is not None
                                 else eval_ids[engine.chunk_len: engine.chunk_len + engine.chunk_len * 3 // 2])
    ours, theirs = runner(prompt), engine(prompt)
    with torch.no_grad():     # the float model itself: how far each quantized path is from it
        fp32 = engine.model(input_ids=prompt[None], use_cache=False).logits[0, -1].float()
    return {
        "target": meta["target"], "soc": meta["soc"], "placement": meta["placement"],
        "npu_subgraphs": len({r["subgraph"] for r in report}) + len(methods), "linears": report,
        "npu_graphs": methods,
        "prefill": {"tokens": prompt.numel(), "chunks": ours.chunks, "policy": runner.last_run.policy,
                    "next_token_pte": int(ours.logits.argmax()), "next_token_engine": int(theirs.logits.argmax()),
                    "same_next_token": bool(ours.logits.argmax() == theirs.logits.argmax()),
                    "logits_sqnr_db": round(sqnr_db(ours.logits, theirs.logits), 1),
                    "next_token_fp32": int(fp32.argmax()),
                    "logits_sqnr_db_vs_fp32": {"pte": round(sqnr_db(ours.logits, fp32), 1),
                                               "engine": round(sqnr_db(theirs.logits, fp32), 1)},
                    "kv_sqnr_db_min": round(min(sqnr_db(a, b) for a, b in zip(ours.past_k + ours.past_v,
                                                                               theirs.past_k + theirs.past_v)), 1)},
    }
