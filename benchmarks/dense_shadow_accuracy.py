"""What a shadow product restricted to a static set of channels would cost in accuracy: the
accuracy a phone program would give up if its shadow products ran inside the NPU graphs.

A static NPU graph can multiply a fixed set of input channels' residues as a small 16-bit GEMM
beside the 8-bit linear, with no trip to the CPU (``htp_dense_shadow.py``); an outlier in any other
channel would be clipped. Two static sets: the dense channels (``dense_channels``: outliers in at
least 1/20 of the calibration tokens) and the peak channels (``quantize.shadow_rows.peak_channels``:
the ``--peak`` channels whose calibrated peak, clipped, would cost the output most). This scores
the embedded model over the evaluation text with the engine's shadow paths as they are (every
channel), with each static set, with the peak set on the linears reading a norm's output (q/k/v,
gate/up) and every channel on the others (o_proj, down_proj: their trip to the CPU kept), and with
no shadow product at all, each beside fp32 with its logits SQNR against fp32.

    .venv/bin/python benchmarks/dense_shadow_accuracy.py [--tokens 4096] [--pruning-rate 0] [--peak 32]
"""
from __future__ import annotations

import argparse
import json

import torch

from llmnpu_delegate.evaluate import eval_windows, quantized_model, window_scores
from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.models import load_model
from llmnpu_delegate.placed_numerics import peak_products
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import quant_config
from llmnpu_delegate.quantize.linear import QuantLinear
from llmnpu_delegate.quantize.shadow_rows import dense_channels, peak_channels
from llmnpu_delegate.text import read_text, tokenize


def shadowed(model) -> dict[str, QuantLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear) and not m.pruned}


def restrict(model, channels_of) -> dict:
    """Each shadow path of ``model`` restricted to ``channels_of(name, linear)`` (None: every
    channel, the engine's own product; ``QuantLinear.shadow_channels``). Returns the channels kept
    per restricted linear."""
    kept = {}
    for name, lin in shadowed(model).items():
        lin.shadow_channels = keep = channels_of(name, lin)
        if keep is not None:
            kept[name] = int(keep.numel())
    return kept


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=4096, help="evaluation tokens (windows of 512)")
    ap.add_argument("--pruning-rate", type=float, default=0.0, help="share of shadow paths pruned (default none)")
    ap.add_argument("--peak", type=int, default=32, help="channels of each linear's peak set")
    args = ap.parse_args()
    lm = load_model()
    windows = eval_windows(tokenize(lm, read_text(None, "eval")), 512, args.tokens)
    calib = default_calibration(lm, True)
    config = quant_config("w8a8-shadow", args.pruning_rate)
    rows = {"fp32": window_scores(lm.model, windows, "fp32", True, lm.model)}
    model, _ = quantized_model(lm, config, calib, True)
    rows["shadow, every channel (the engine)"] = window_scores(model, windows, "shadow", True, lm.model)
    p = config.clip_percentile

    def dense(name, lin):
        stats = calib.layers[name]
        return dense_channels(stats.channel_outliers[p], stats.elements)

    def peak(name, lin):
        return peak_channels(calib.layers[name].channel_absmax, lin.clip, lm.model.get_submodule(name).weight, args.peak)

    def split(name, lin):   # placement piece peak's numerics (``llmnpu eval --placement peak``)
        return kept.get(name)

    kept = peak_products(lm, model, calib, args.peak)

    sizes = {}
    for label, channels_of in (("shadow, dense channels only", dense), (f"shadow, {args.peak} peak channels only", peak),
                               ("peak channels on q/k/v and gate/up, every channel on o/down", split),
                               ("no shadow product (clipped)", lambda n, lin: torch.empty(0, dtype=torch.long))):
        sizes[label] = sum(restrict(model, channels_of).values())
        rows[label] = window_scores(model, windows, label.split(",")[0], True, lm.model)
    print(json.dumps({"cpu": detect().model, "tokens": int(windows.numel()), "shadowed_linears": len(shadowed(model)),
                      "channels_kept": sizes}, indent=1))
    base = rows["fp32"]["ppl"]
    print("| shadow products | perplexity | vs fp32 | logits SQNR vs fp32 |\n|---|---|---|---|")
    for name, r in rows.items():
        sqnr = f"{r['logits_sqnr_db']:.1f} dB" if "logits_sqnr_db" in r and name != "fp32" else ""
        print(f"| {name} | {r['ppl']:.3f} | {r['ppl'] / base:.3f}x | {sqnr} |")


if __name__ == "__main__":
    main()
