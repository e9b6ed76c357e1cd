"""What each way of storing the embedding table and the LM head costs in accuracy, on the float model.

    .venv/bin/python benchmarks/storage_accuracy.py [--tokens 2048] [--window 512]

The phone program keeps the embedding table (which the embedded model's LM head shares) in fp32:
108 MiB of its 339 MiB. Each variant below changes only that storage in the float model, and is
scored on the evaluation text (never the calibration text) against the unchanged model: perplexity,
and the share of positions whose next-token argmax is unchanged (teacher-forced by the text).

- ``table fp16``: the table rounded to fp16, for the lookup and the head.
- ``table int8 rows``: INT8 per row (symmetric, a scale per token), for the lookup and the head.
- ``head int8 dynamic``: the head as the INT8 decode step runs it (weights INT8 per output channel,
  activations quantized per token at run time, asymmetric uint8), the lookup in fp32.
- ``both int8``: the INT8 table for the lookup and the INT8 dynamic head.
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F

from llmnpu_delegate.evaluate import eval_windows
from llmnpu_delegate.models import load_model
from llmnpu_delegate.text import read_text, tokenize


def int8_rows(w: torch.Tensor) -> torch.Tensor:
    """``w`` [N, K] through INT8 with one symmetric scale per row, dequantized."""
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def per_token_uint8(x: torch.Tensor) -> torch.Tensor:
    """``x`` [..., K] through asymmetric uint8 per row (the dynamic activation quantization), dequantized."""
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = ((hi - lo) / 255).clamp(min=1e-12)
    zero = torch.round(-lo / scale)
    return ((torch.round(x / scale) + zero).clamp(0, 255) - zero) * scale


@torch.inference_mode()
def score(model, windows: torch.Tensor, table: torch.Tensor, head, ref_argmax=None):
    """Perplexity and next-token argmax per position, with ``table`` for the lookup and ``head``."""
    nll, count, argmax = 0.0, 0, []
    for row in windows:
        hidden = model.model(inputs_embeds=F.embedding(row[None], table)).last_hidden_state[0]
        logits = head(hidden)[:-1]
        nll += float(F.cross_entropy(logits, row[1:], reduction="sum"))
        count += row.numel() - 1
        argmax.append(logits.argmax(-1))
    argmax = torch.cat(argmax)
    agree = float((argmax == ref_argmax).float().mean()) if ref_argmax is not None else 1.0
    return math.exp(nll / count), agree, argmax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--window", type=int, default=512)
    args = ap.parse_args()
    lm = load_model()
    model = lm.model.eval()
    windows = eval_windows(tokenize(lm, read_text(None, "eval")), args.window, args.tokens)
    table = model.model.embed_tokens.weight.detach().float()
    w_head = model.lm_head.weight.detach().float()
    table8, head8 = int8_rows(table), int8_rows(w_head)
    variants = {
        "fp32 (today)": (table, lambda h: h @ w_head.t()),
        "table fp16": (table.half().float(), lambda h: h @ w_head.half().float().t()),
        "table int8 rows": (table8, lambda h: h @ head8.t()),
        "head int8 dynamic": (table, lambda h: per_token_uint8(h) @ head8.t()),
        "both int8": (table8, lambda h: per_token_uint8(h) @ head8.t()),
    }
    tied = model.config.tie_word_embeddings
    print(f"{windows.numel()} evaluation tokens in windows of {args.window}; head tied to the table: {tied}")
    ref_ppl, _, ref_argmax = score(model, windows, *variants["fp32 (today)"])
    print(f"{'storage':<20} {'perplexity':>10} {'vs fp32':>8} {'argmax agreement':>17}")
    for name, (tab, head) in variants.items():
        ppl, agree, _ = score(model, windows, tab, head, ref_argmax)
        print(f"{name:<20} {ppl:10.3f} {ppl / ref_ppl:8.4f} {agree:17.4f}")


if __name__ == "__main__":
    main()
