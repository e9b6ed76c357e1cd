"""How many shadow rows to keep in memory: outliers served from the hot rows against the bytes kept.

    .venv/bin/python benchmarks/hot_channels.py [--tokens 4096] [--window 512]

A shadowed linear keeps the float rows of its hot input channels in the program (and in memory);
an outlier in any other channel costs a row read from the rows file. The hot set is the smallest
set of channels covering a share (``hot_coverage``, default 0.8) of the outliers counted on the
calibration text. For each coverage this prints, over the linears the default settings shadow
(automatic pruning): the hot rows' bytes (float32, as the program's methods hold them), the share
of input channels they are, and the share of outliers on the evaluation text (never the
calibration text) that they serve, with the cold rows a runner reads per chunk of that text (one
read per chunk and cold channel hit). The last row is a program's own set (``dense_channels``:
channels with outliers in at least 1/20 of the calibration tokens, chosen by cost, not coverage).
"""
from __future__ import annotations

import argparse

import torch

from llmnpu_delegate.evaluate import eval_windows
from llmnpu_delegate.models import load_model
from llmnpu_delegate.prepare import default_calibration
from llmnpu_delegate.quantize import quant_config
from llmnpu_delegate.quantize.apply import plan_linears
from llmnpu_delegate.quantize.calibrate import quantizable_linears
from llmnpu_delegate.quantize.shadow_rows import dense_channels, hot_channels
from llmnpu_delegate.runtime.engine import choose_host_pruning
from llmnpu_delegate.text import read_text, tokenize

COVERAGES = (0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99, 1.0)


@torch.inference_mode()
def eval_counts(model, linears: dict, clips: dict, windows: torch.Tensor, chunk: int) -> tuple[dict, dict]:
    """Per shadowed linear: [K] count of evaluation-text inputs beyond its clip, and [K] count of
    chunks in which the channel had one (a runner reads a cold row once per chunk that hits it)."""
    counts = {n: torch.zeros(linears[n].in_features, dtype=torch.int64) for n in clips}
    chunks = {n: torch.zeros(linears[n].in_features, dtype=torch.int64) for n in clips}

    def hook(name):
        def count(_mod, args):
            beyond = args[0].detach().reshape(-1, chunk, args[0].shape[-1]).float().abs() > clips[name]
            counts[name] += beyond.sum((0, 1))
            chunks[name] += beyond.any(1).sum(0)
        return count

    handles = [linears[n].register_forward_pre_hook(hook(n)) for n in clips]
    try:
        for row in windows:
            model.model(input_ids=row[None], use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return counts, chunks


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256, help="the program's chunk length (divides --window)")
    args = ap.parse_args()
    lm = load_model()
    calib = default_calibration(lm, progress=False)
    config = quant_config("w8a8-shadow", None)
    choose_host_pruning(lm, calib, config, progress=False)
    plans = plan_linears(lm.model, calib, config, lm.fingerprint, progress=False)
    shadowed = {n: p for n, p in plans.items() if p.shadow}
    linears = quantizable_linears(lm.model)
    windows = eval_windows(tokenize(lm, read_text(None, "eval")), args.window, args.tokens)
    counts, chunk_hits = eval_counts(lm.model, linears, {n: p.clip for n, p in shadowed.items()}, windows,
                                     args.chunk)
    n_chunks = windows.numel() // args.chunk
    total = sum(int(c.sum()) for c in counts.values())
    channels = sum(linears[n].in_features for n in shadowed)
    p = config.clip_percentile
    print(f"{len(shadowed)} shadowed linears, {channels} input channels; {windows.numel()} evaluation tokens, "
          f"{total} outliers beyond the clip (p{p})")
    print(f"{'coverage':>8} {'hot rows MiB':>12} {'channels':>9} {'served (eval)':>14} {'cold rows / chunk':>18}")
    choices = {f"{c:.2f}": (lambda s, c=c: hot_channels(s.channel_outliers[p], c)) for c in COVERAGES}
    choices["program"] = lambda s: dense_channels(s.channel_outliers[p], s.elements)
    for label, choose in choices.items():
        hot_bytes, hot_channels_n, served, reads = 0, 0, 0, 0
        for n in shadowed:
            hot = choose(calib.layers[n])
            hot_bytes += 4 * linears[n].out_features * hot.numel()
            hot_channels_n += hot.numel()
            served += int(counts[n][hot].sum())
            reads += int(chunk_hits[n].sum() - chunk_hits[n][hot].sum())
        print(f"{label:>8} {hot_bytes / 2**20:>12.1f} {hot_channels_n / channels:>9.3f} {served / max(total, 1):>14.3f} "
              f"{reads / n_chunks:>18.0f}")


if __name__ == "__main__":
    main()
