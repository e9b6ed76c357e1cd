"""What a placement does to the embedded model's accuracy on the engine: the last token's logits of
evaluation windows against fp32, for the paper's placement and for attention on the NPU (16-bit
encodings, kernels/npu_attention.py) with a 16-bit and an 8-bit K/V window. The other pieces run
with the CPU's kernels wherever they sit, so they change nothing (tests/test_placement.py).

    python benchmarks/placement_accuracy.py [--windows 24] [--window 512] [--chunk 256]
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from llmnpu_delegate.evaluate import eval_windows
from llmnpu_delegate.kernels.cpu import detect
from llmnpu_delegate.models import load_model
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.text import read_text, tokenize

VARIANTS = {"paper": {}, "attention-half, 16-bit K/V": {"placement": "attention-half", "npu_kv_bits": 16},
            "attention-half, 8-bit K/V": {"placement": "attention-half", "npu_kv_bits": 8}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--windows", type=int, default=24)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=256)
    args = ap.parse_args()
    lm = load_model("smollm2-135m")
    windows = eval_windows(tokenize(lm, read_text(None, "eval")), args.window,
                           args.windows * (args.window - 1))[: args.windows]
    with torch.inference_mode():
        ref = [lm.model(input_ids=w[None]).logits[0, -1].float().log_softmax(-1) for w in windows]
    print(f"CPU: {detect().model}; {len(windows)} windows of {args.window} tokens, chunk {args.chunk}")
    print("| placement | mean KL to fp32 | top-1 agreement |\n|---|---|---|")
    for name, kw in VARIANTS.items():
        engine = Prefiller(lm, args.chunk, progress=False, **kw)
        kl = top1 = 0.0
        for w, r in zip(windows, ref):
            got = engine(w[None]).logits.float().log_softmax(-1)
            kl += float(F.kl_div(got, r, log_target=True, reduction="sum"))
            top1 += float(got.argmax() == r.argmax())
        print(f"| {name} | {kl / len(windows):.4f} | {top1:.0f}/{len(windows)} |", flush=True)


if __name__ == "__main__":
    main()
