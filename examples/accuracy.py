"""The accuracy harness from Python: perplexity of fp32 and of each W8A8 mode on held-out text.

    .venv/bin/python examples/accuracy.py [--max-tokens 4096] [--modes fp32 w8a8 w8a8-shadow]

Calibration uses the shipped news text, evaluation the shipped Wikipedia text (disjoint sources).
Same numbers as `llmnpu eval --model smollm2-135m`.
"""
import argparse

from llmnpu_delegate import load_model
from llmnpu_delegate.evaluate import MODES, evaluate
from llmnpu_delegate.quantize import CalibConfig
from llmnpu_delegate.text import read_text, tokenize

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="smollm2-135m")
ap.add_argument("--max-tokens", type=int, default=4096)
ap.add_argument("--window", type=int, default=512)
ap.add_argument("--modes", nargs="+", choices=list(MODES), default=["fp32", "w8a8", "w8a8-shadow",
                                                                     "w8a8-shadow-pruned"])
args = ap.parse_args()

lm = load_model(args.model)
eval_ids = tokenize(lm, read_text(None, "eval"))
calib_ids = tokenize(lm, read_text(None, "calib"))
result = evaluate(lm, eval_ids, calib_ids, args.modes, args.window, args.max_tokens, CalibConfig())
base = result["results"]["fp32"]["ppl"] if "fp32" in result["results"] else None
print(f"perplexity of {result['model']} on {result['tokens']} tokens (windows of {result['window']})")
for mode, r in result["results"].items():
    rel = f"  {r['ppl'] / base:.3f}x fp32" if base else ""
    print(f"{mode:<22}{r['ppl']:9.3f}{rel}")
