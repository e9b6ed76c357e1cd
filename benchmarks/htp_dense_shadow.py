"""A shadowed linear with a static set of channels' shadow product inside one HTP graph, on the
embedded model's own inputs: what a phone program with fewer graph boundaries would run.

The graph takes the linear's input at 16 bits. The 8-bit linear reads it through a clamp at the
clip, requantized to 8 bits, and writes an 8-bit output that joins the sum at 16 bits; beside it
the kept channels' residues ``x - clamp(x, +-clip)`` go through a 16-bit-activation, 8-bit-weight
GEMM over those channels' weight rows: the peak channels (``peak_channels``) or the dense ones
(``dense_channels``). HTP refuses a GEMM of 8-bit input and 16-bit output, and of 16-bit input and
8-bit output; this form is the one it lowers as a single graph. Each linear's output is compared
with float, with the engine's (every channel's outliers on the CPU) and with the engine restricted
to each set, as SQNR against float, and the graph with its PyTorch reference, in output steps (the
reference's own SQNR beside: the linear's 8-bit output bounds what the graph can reach).

    .venv/bin/python benchmarks/htp_dense_shadow.py [--linears 4] [--match q_proj] [--channels peak|dense]
                                                    [--peak 32] [--rows 256] [--soc SM8750] [--no-htp]
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from htp_attention import run_method
from torch import nn
from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e
from torchao.quantization.pt2e.quantizer import QuantizationAnnotation, Quantizer

from llmnpu_delegate import backends
from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.kernels.npu_attention import Encoding
from llmnpu_delegate.kernels.ops import QMAX, quantize_weight, w8a8_linear
from llmnpu_delegate.lower.encodings import ANNOTATION, activation_spec, fixed_spec, weight_spec
from llmnpu_delegate.models import load_model
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.qnn.sdk import activate
from llmnpu_delegate.quantize import quant_config
from llmnpu_delegate.quantize.apply import plan_linears
from llmnpu_delegate.quantize.calibrate import quantizable_linears
from llmnpu_delegate.quantize.shadow_rows import peak_channels
from llmnpu_delegate.quantize.sqnr import sqnr_db
from llmnpu_delegate.text import read_text, tokenize


class DenseShadowLinear(nn.Module):
    def __init__(self, weight, dense, clip):
        super().__init__()
        self.weight = nn.Parameter(weight.clone())
        self.dense_weight = nn.Parameter(weight[:, dense].clone())
        # the dense channels picked by a one-hot GEMM: HTP's Gather refuses 16-bit data here
        self.select = nn.Parameter(F.one_hot(dense, weight.shape[1]).float())
        self.clip = clip

    def forward(self, x):
        # the 8-bit linear reads the input through a 16-bit clamp: an input read at two precisions
        # gets one of them from the quantizer
        y = F.linear(x.clamp(-self.clip, self.clip), self.weight)
        xd = F.linear(x, self.select)
        residue = xd - xd.clamp(-self.clip, self.clip)
        return y + F.linear(residue, self.dense_weight)


def annotator(x_enc, clip, y8, residue_enc, out_enc):
    """Encodings of the graph's pieces: the 16-bit input, the 8-bit linear (in at the clip's scale,
    out on ``y8``), the residues and their product at 16 bits, the sum at 16 bits."""
    class Annotate(Quantizer):
        def annotate(self, m):
            nodes = [n for n in m.graph.nodes if n.op == "call_function"]
            main, select, shadow = [n for n in nodes if "linear" in str(n.target)]
            xc = main.args[0]
            x = xc.args[0]
            main.meta[ANNOTATION] = QuantizationAnnotation(
                {xc: activation_spec(clip / 127, "qnn"), main.args[1]: weight_spec("channel")}, y8, _annotated=True)
            select.meta[ANNOTATION] = QuantizationAnnotation(
                {x: fixed_spec(x_enc), select.args[1]: weight_spec("channel")}, fixed_spec(x_enc), _annotated=True)
            # a clamp's output on its own range: lowering may fold a clamp into its output's encoding
            clamped = fixed_spec(Encoding.of_range(-clip, clip, 16))
            xc.meta[ANNOTATION] = QuantizationAnnotation({x: fixed_spec(x_enc)}, clamped, _annotated=True)
            for n in nodes:
                if n is not xc and ("clamp" in str(n.target) or "sub" in str(n.target)):
                    n.meta[ANNOTATION] = QuantizationAnnotation(
                        {}, clamped if "clamp" in str(n.target) else fixed_spec(residue_enc), _annotated=True)
            shadow.meta[ANNOTATION] = QuantizationAnnotation(
                {shadow.args[0]: fixed_spec(residue_enc), shadow.args[1]: weight_spec("channel")},
                fixed_spec(out_enc["d"]), _annotated=True)
            (add,) = [n for n in nodes if "add" in str(n.target)]
            add.meta[ANNOTATION] = QuantizationAnnotation(
                {add.args[0]: fixed_spec(out_enc["y"]), add.args[1]: fixed_spec(out_enc["d"])},
                fixed_spec(out_enc["out"]), _annotated=True)
            return m

        def validate(self, m):
            pass
    return Annotate()


def captured_inputs(lm, names, rows: int) -> dict:
    ids = tokenize(lm, read_text(None, "eval"))[:rows]
    seen = {}
    mods = dict(lm.model.named_modules())
    hooks = [mods[n].register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, a[0][0].detach()))
             for n in names]
    with torch.no_grad():   # not inference mode: the captured rows are exported and traced later
        lm.model(input_ids=ids[None], use_cache=False)
    for h in hooks:
        h.remove()
    return seen


def on_htp(w, dense, clip, x, y, residue, dense_w, want, soc: str) -> dict:
    """The graph lowered and run on the simulator: its output, whether it is one graph, and its
    distance from its PyTorch reference in output steps."""
    def enc(t):
        return Encoding.of_range(float(t.min()), float(t.max()), 16)
    y8 = activation_spec(float(y.abs().max()) / 127, "qnn")
    out_enc = {"y": enc(y), "d": enc(residue @ dense_w.T), "out": enc(want)}
    graph = torch.export.export(DenseShadowLinear(w, dense, clip), (x,), strict=False).module()
    prepared = prepare_pt2e(graph, backends.get("qnn").quantizer(annotator(enc(x), clip, y8, enc(residue), out_enc)))
    prepared(x)
    converted = convert_pt2e(prepared)
    ref = converted(x)
    t = time.perf_counter()
    edge = backends.get("qnn").lower({"dense_shadow": (converted, (x,))}, soc)
    lowered = time.perf_counter() - t
    calls = [str(n.target) for n in edge.exported_program("dense_shadow").graph.nodes if n.op == "call_function"]
    got = run_method(edge, (x,))
    steps = (got - ref).abs() / out_enc["out"].scale
    return {"got": got, "ref": ref, "one_graph": calls.count("executorch_call_delegate") == 1 and len(calls) <= 2,
            "htp_vs_reference_steps": {"max": round(float(steps.max()), 2), "mean": round(float(steps.mean()), 3)},
            "lower_s": round(lowered, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--linears", type=int, default=4, help="how many shadowed linears (most outliers first)")
    ap.add_argument("--rows", type=int, default=256, help="rows of the evaluation text per linear")
    ap.add_argument("--soc", default="SM8750")
    ap.add_argument("--no-htp", action="store_true", help="the PyTorch comparisons only (no simulator)")
    ap.add_argument("--peak", type=int, default=32, help="channels of the peak set (largest clipped error)")
    ap.add_argument("--channels", choices=("peak", "dense"), default="peak", help="the set the HTP graph holds")
    ap.add_argument("--match", default="", help="only linears whose name contains this (e.g. q_proj)")
    args = ap.parse_args()
    activate()
    lm = load_model()
    calib = default_calibration(lm, True)
    config = quant_config("w8a8-shadow", 0.0)
    plans = plan_linears(lm.model, calib, config, lm.fingerprint, True)
    linears = quantizable_linears(lm.model)
    # a graph needs dense channels to hold a product; the PyTorch comparisons take every shadowed linear
    ranked = sorted((n for n, p in plans.items() if p.shadow and args.match in n),
                    key=lambda n: -calib.layers[n].outlier_fraction(config.clip_percentile))[: args.linears]
    inputs = captured_inputs(lm, ranked, args.rows)
    for name in ranked:
        plan, w, x = plans[name], linears[name].weight.detach().float(), inputs[name].float()
        clip, dense = plan.clip, plan.dense
        flt = x @ w.T
        # the engine's product: its INT8 GEMM at the clip, plus the residues of every channel (or of a set) in float
        y = w8a8_linear(x, clip / QMAX, *quantize_weight(w, "channel"))
        residue = x - x.clamp(-clip, clip)
        engine = y + residue @ w.T
        engine_dense = y + residue[:, dense] @ w[:, dense].T
        peak = peak_channels(calib.layers[name].channel_absmax, clip, w, args.peak)
        engine_peak = y + residue[:, peak] @ w[:, peak].T

        row = {}
        held, want = (peak, engine_peak) if args.channels == "peak" else (dense, engine_dense)
        if not args.no_htp and held.numel():
            row = on_htp(w, held, clip, x, y, residue[:, held], w[:, held], want, args.soc)
        print(json.dumps({
            "linear": name, "dense_channels": int(dense.numel()), "in_features": x.shape[1],
            "outliers_beyond_clip": int((x.abs() > clip).sum()),
            "outliers_in_cold_channels": int((x.abs() > clip).sum() - (x[:, dense].abs() > clip).sum()),
            "sqnr_vs_float": {**({f"htp_{args.channels}": round(float(sqnr_db(flt, row.pop("got"))), 2),
                                  # the graph's own numerics: its linear's 8-bit output bounds it
                                  f"graph_reference_{args.channels}": round(float(sqnr_db(flt, row.pop("ref"))), 2)}
                                 if row else {}),
                              "engine_every_channel": round(float(sqnr_db(flt, engine)), 2),
                              "engine_dense_only": round(float(sqnr_db(flt, engine_dense)), 2),
                              f"engine_peak_{args.peak}_only": round(float(sqnr_db(flt, engine_peak)), 2),
                              "no_shadow": round(float(sqnr_db(flt, y)), 2)},
            **row}), flush=True)
    print(f"# smollm2-135m, {args.rows} rows of the evaluation text, {args.soc} on the HTP simulator; "
          f"host {detect().model}")


if __name__ == "__main__":
    main()
