"""The block norms as HTP graphs on the embedded model: every norm's method on Qualcomm's simulator
against the reference it must compute (``kernels/npu_norm.py``) and against the float norm.

Each norm's encodings are the engine's (``prepare.norm_ranges_of``: the calibration text); its
input rows are the evaluation text's first ``--rows`` tokens through the float model.

    python benchmarks/htp_norms.py [--rows 256] [--soc SM8750] [--layers N]
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from htp_attention import run_method

from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.kernels.npu_norm import NormEncodings, npu_rms_norm
from llmnpu_delegate.lower.norm_method import lower_norm
from llmnpu_delegate.models import load_model
from llmnpu_delegate.prepare import norm_modules, norm_ranges_of
from llmnpu_delegate.qnn.sdk import activate
from llmnpu_delegate.quantize.sqnr import sqnr_db
from llmnpu_delegate.text import read_text, tokenize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=256, help="the engine's chunk (its calibration's token count)")
    ap.add_argument("--soc", default="SM8750")
    ap.add_argument("--layers", type=int, default=None, help="the first N layers only")
    args = ap.parse_args()
    activate()
    lm = load_model("smollm2-135m")
    ranges, modules = norm_ranges_of(lm, args.chunk), norm_modules(lm.model)
    keys = [k for k in sorted(modules) if args.layers is None or k[0] < args.layers]
    seen = {}
    hooks = [modules[k].register_forward_hook(lambda m, a, out, k=k: seen.update({k: (a[0][0].float(), out[0].float())}))
             for k in keys]
    with torch.inference_mode():
        lm.model(tokenize(lm, read_text(None, "eval"))[: args.rows][None])
    for h in hooks:
        h.remove()
    rows = []
    for key in keys:
        module, (x, flt) = modules[key], seen[key]
        x, flt = x.clone(), flt.clone()
        enc = NormEncodings.of_ranges(ranges[key], module.weight)
        ref = npu_rms_norm(x, module.weight, module.variance_epsilon, enc)
        t = time.perf_counter()
        edge = lower_norm(f"norm_{key[0]}_{key[1]}", enc, module.weight, module.variance_epsilon, (x,), args.soc)
        lowered = time.perf_counter() - t
        got = run_method(edge, (x,))
        steps = ((got - ref).abs() / enc.out.scale).round()
        rows.append({"layer": key[0], "norm": key[1], "input_range": [round(v, 1) for v in ranges[key]["x"]],
                     "max_steps": int(steps.max()), "off_by_1": round(float((steps == 1).float().mean()), 4),
                     "over_1": int((steps > 1).sum()), "values": steps.numel(),
                     "sqnr_vs_float_htp": round(sqnr_db(flt, got), 2),
                     "sqnr_vs_float_reference": round(sqnr_db(flt, ref), 2), "lower_s": round(lowered, 1)})
        print(json.dumps(rows[-1]), flush=True)
    print(f"# smollm2-135m, {args.rows} rows of evaluation text, {args.soc} on the HTP simulator; host {detect().model}")
    print(f"norms {len(rows)}: max steps {max(r['max_steps'] for r in rows)}, more than one step off "
          f"{sum(r['over_1'] for r in rows)} of {sum(r['values'] for r in rows)} values, one step off (worst norm) "
          f"{max(r['off_by_1'] for r in rows):.3f}; SQNR vs float: HTP min {min(r['sqnr_vs_float_htp'] for r in rows):.1f}"
          f" / median {statistics.median(r['sqnr_vs_float_htp'] for r in rows):.1f} dB, reference min "
          f"{min(r['sqnr_vs_float_reference'] for r in rows):.1f} / median "
          f"{statistics.median(r['sqnr_vs_float_reference'] for r in rows):.1f} dB")


if __name__ == "__main__":
    main()
