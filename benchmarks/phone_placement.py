"""Our phone program under each placement, predicted by the phone model, beside the Genie form
(predicted, and published where AI Hub has the row): the table in docs/simulate.md.

    python benchmarks/phone_placement.py [--soc SM8750] [--models qwen3-0.6b qwen3-1.7b]
                                         [--lengths 1024 4096] [--chunks 256 512]
                                         [--placements paper norms attention-half block]
"""
from __future__ import annotations

import argparse

from llmnpu_delegate.backends import get, placements
from llmnpu_delegate.models import model_config
from llmnpu_delegate.simulate.device import load_device
from llmnpu_delegate.simulate.phone import choose_placement
from llmnpu_delegate.simulate.programs import PROGRAMS
from llmnpu_delegate.simulate.whole_npu import predict


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--soc", default="SM8750")
    ap.add_argument("--models", nargs="+", default=["qwen3-0.6b", "qwen3-1.7b"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096])
    ap.add_argument("--chunks", nargs="+", type=int, default=[256, 512])
    ap.add_argument("--placements", nargs="+", default=None,
                    help="placements to predict (default: every one the qnn backend's pieces allow)")
    args = ap.parse_args()
    names = args.placements or placements(get("qnn"))
    print(f"| model | tokens | chunk | {' | '.join(names)} | genie predicted |\n|" + "---|" * (len(names) + 4))
    for model in args.models:
        spec = f"random:{model}"
        for length in args.lengths:
            genie = predict(model_config(spec), PROGRAMS["genie"], load_device(args.soc), length, length)["tok_s"]
            for chunk in args.chunks:
                _, rows = choose_placement(spec, chunk, args.soc, length, names, progress=False)
                tok_s = {r["placement"]: r["tok_s"] for r in rows}
                cells = " | ".join(f"{tok_s[n]:,.0f}" for n in names)
                print(f"| {model} | {length:,} | {chunk} | {cells} | {genie:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
