"""Programs against the float model on many windows of evaluation text, through the native runner.

    .venv/bin/python benchmarks/program_windows.py a.pte [b.pte ...] [--windows 40] [--length 400]

One prompt cannot rank two programs: a change far below the quantization error (float16 shadow rows,
say) moves some NPU outputs across an INT8 step, and the program's last-token logits move by much
more (15.7 dB SQNR between two such programs on the demo prompt). This scores each program's
last-token logits on ``--windows`` windows of ``--length`` tokens spread over the evaluation text
(never the calibration text): mean and median SQNR against the float model, and the share of windows
whose next token is the float model's.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from llmnpu_delegate.models import load_model
from llmnpu_delegate.runtime.native import run_native
from llmnpu_delegate.runtime.validate import sqnr_db
from llmnpu_delegate.text import read_text, tokenize


def last_logits(pte: Path, meta: dict, ids: torch.Tensor) -> torch.Tensor:
    with tempfile.NamedTemporaryFile(suffix=".bin") as f:
        run_native(pte, ids.tolist(), meta, 1, "ooo", logits_out=f.name)
        return torch.from_numpy(np.fromfile(f.name, dtype="<f4").copy())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pte", nargs="+", type=Path)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--length", type=int, default=400)
    args = ap.parse_args()
    lm = load_model()
    ids = tokenize(lm, read_text(None, "eval"))
    metas = {p: json.loads(p.with_suffix(".json").read_text()) for p in args.pte}
    length = min([args.length] + [m["context"] - 1 for m in metas.values()])
    starts = [i * (ids.numel() - length) // args.windows for i in range(args.windows)]
    scores = {p: [] for p in args.pte}
    for s in starts:
        window = ids[s:s + length]
        with torch.no_grad():
            ref = lm.model(window[None]).logits[0, -1].float()
        for p, meta in metas.items():
            got = last_logits(p, meta, window)
            scores[p].append((float(sqnr_db(got, ref)), float(got.argmax() == ref.argmax())))
    print(f"{args.windows} windows of {length} evaluation tokens; last-token logits against the float model")
    for p, rows in scores.items():
        a = np.array(rows)
        print(f"  {p}: SQNR mean {a[:, 0].mean():.2f} dB, median {np.median(a[:, 0]):.2f} dB; "
              f"next token = float model's in {a[:, 1].mean():.3f} of windows")


if __name__ == "__main__":
    main()
