"""The engine's tail program against padded last chunks, on the prompts a conversation sends.

Usage: python benchmarks/tail_program.py [--model smollm2-135m] [--chunk 256] [--repeats 5]

Two engines of one model, the same but for ``tail_len`` (the default "auto": a quarter chunk; and
None: every last chunk padded to the chunk length), run the turns of ``llmnpu bench --turns``'s
agent and chat forms as continuations of their past (the past prefilled untimed just before), and a
fresh 517-token prompt (two chunks and 5 tokens at chunk 256). Interleaved engine by engine,
medians of ``--repeats``; the rows each ran, and whether their logits and K/V agree.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from llmnpu_delegate.measure.turns import FORMS, workload
from llmnpu_delegate.kernels import int8_path
from llmnpu_delegate.models import load_model
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.text import read_text, tokenize


def prompts(lm, turns: int = 4) -> dict[str, tuple[int, torch.Tensor]]:
    """name -> (past tokens, whole prompt): each form's turns (answers of fixed filler ids), a fresh prompt."""
    out = {}
    for form in ("agent", "chat"):
        fixed, news = workload(lm, form, turns)
        answer = torch.arange(FORMS[form][2]) + 1000
        history = torch.cat([fixed, news[0]])
        out[f"{form} turn 1"] = (0, history)
        for t, new in enumerate(news[1:], 2):
            past = history.numel()
            history = torch.cat([history, answer, new])
            out[f"{form} turn {t}"] = (past, history)
    out["fresh, 517 tokens"] = (0, tokenize(lm, read_text(None, "calib"))[5000:5517])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    lm = load_model(args.model)
    engines = {"padded": Prefiller(lm, args.chunk, progress=False, tail_len=None),
               "tail": Prefiller(lm, args.chunk, progress=False)}
    work = prompts(lm)
    times = {(e, p): [] for e in engines for p in work}
    runs = {}
    for _ in range(args.repeats):
        for e, engine in engines.items():
            for p, (past, ids) in work.items():
                kv = None
                if past:
                    before = engine(ids[:past])
                    kv = (before.past_k, before.past_v)
                start = time.perf_counter()
                runs[(e, p)] = engine(ids[past:], past=kv)
                times[(e, p)].append(time.perf_counter() - start)
    m = int8_path.describe()
    print(f"{args.model}, chunk {args.chunk}, tail program of {engines['tail'].tail_len} rows; "
          f"cpu {m['cpu']} ({m['isa']}); medians of {args.repeats}, ms")
    print(f"{'prompt':22} {'past':>5} {'new':>5} {'rows':>9} {'padded':>8} {'tail':>8} {'ratio':>6}  same results")
    for p, (past, ids) in work.items():
        a, b = (statistics.median(times[(e, p)]) for e in ("padded", "tail"))
        x, y = runs[("padded", p)], runs[("tail", p)]
        same = max((u - v).abs().max().item() for u, v in zip([x.logits, *x.past_k, *x.past_v],
                                                               [y.logits, *y.past_k, *y.past_v]))
        print(f"{p:22} {past:5} {ids.numel() - past:5} {x.rows:4}->{y.rows:<4} {1e3 * a:8.0f} {1e3 * b:8.0f} "
              f"{b / a:6.2f}  {'bit for bit' if same == 0 else f'max diff {same:.2g}'}")


if __name__ == "__main__":
    main()
