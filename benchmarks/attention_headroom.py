"""How far attention's 16-bit grids should reach beyond the calibrated ranges: each layer's
reference attention (``kernels/npu_attention.py``) against float attention, on calibration text
held apart from the chunks the ranges come from, for a few headroom factors and both window widths.
Chosen on calibration text, never on the evaluation text.

    python benchmarks/attention_headroom.py [--chunk 256]
"""
from __future__ import annotations

import argparse
import statistics
from unittest import mock

import torch

from htp_attention import captured_attention
from llmnpu_delegate.kernels import npu_attention as na
from llmnpu_delegate.kernels.attention import chunk_attention
from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.models import load_model
from llmnpu_delegate.prepare import ATTENTION_CALIB_CHUNKS, attention_ranges_of
from llmnpu_delegate.text import calibration_ids

FACTORS = (1.0, 1.25, 1.5, 2.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    lm = load_model("smollm2-135m")
    ranges = attention_ranges_of(lm, args.chunk)
    held = calibration_ids(lm)[2 * ATTENTION_CALIB_CHUNKS * args.chunk:]   # past the ranges' chunks
    captured = captured_attention(lm, args.chunk, held)
    print(f"smollm2-135m, chunk {args.chunk}, {len(captured)} layers, held-apart calibration text; "
          f"host {detect().model}")
    print("| headroom | K/V bits | median dB vs float | worst layer dB |\n|---|---|---|---|")
    for factor in FACTORS:
        for bits in (16, 8):
            db = []
            for layer, (q, k, v, mask, scaling) in sorted(captured.items()):
                want = chunk_attention(q, k, v, mask, scaling, 0.0)
                with mock.patch.object(na, "HEADROOM", factor):
                    enc = na.AttentionEncodings.of_ranges(ranges[layer], bits)
                got = na.npu_attention(q, k, v, mask, scaling, enc)
                db.append(float(10 * torch.log10(want.pow(2).sum() / (got - want).pow(2).sum())))
            print(f"| {factor} | {bits} | {statistics.median(db):.1f} | {min(db):.1f} |", flush=True)


if __name__ == "__main__":
    main()
