"""Where our phone program stands against the program users would pick instead, on the phone model.

For each model, SoC and prompt length: our `.pte` under ``--placement`` (program `ours`: W8A8
linears on the NPU, out of order, automatic pruning for that SoC and placement; by default
`attention-half`, which `llmnpu export --backend qnn` chooses for each of these models: RoPE,
attention and the norms on the NPU too, the shadow paths, residual adds and activation on the CPU;
`paper` keeps all float work on the CPU), the Genie / ExecuTorch form predicted (program `genie`: everything on the NPU, w4a16, a fixed
window of the prompt's length), and that form as Qualcomm AI Hub published it (Genie-X on QAIRT,
`geniex_qairt` rows of `simulate/data/aihub.csv`; its prompt is the perf prompt of that context,
shorter than the context). Prints a markdown table (the one in docs/simulate.md):

    python benchmarks/phone_standing.py [--socs SM8650 SM8750 SM8850] [--lengths 512 1024 4096]
        [--placement attention-half]
"""
from __future__ import annotations

import argparse

from llmnpu_delegate.models import model_config
from llmnpu_delegate.simulate.device import load_device
from llmnpu_delegate.simulate.measured import measurements
from llmnpu_delegate.simulate.phone import prepare, simulate_prefill
from llmnpu_delegate.simulate.programs import PROGRAMS
from llmnpu_delegate.simulate.whole_npu import predict

MODELS = {"Qwen3-0.6B": "qwen3-0.6b", "Llama-3.2-1B": "llama-1b", "Qwen3-1.7B": "qwen3-1.7b",
          "Qwen1.5-1.8B": "qwen1.5-1.8b"}


def published(shape: str, soc: str, context: int) -> float | None:
    rows = [m.prefill_tok_s for m in measurements() if m.shape == shape and m.soc == soc and m.context == context
            and m.runtime == "geniex_qairt" and m.precision == "w4a16"]
    return max(rows) if rows else None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--socs", nargs="+", default=["SM8650", "SM8750", "SM8850"])
    ap.add_argument("--lengths", nargs="+", type=int, default=[512, 1024, 4096])
    ap.add_argument("--placement", default="attention-half")
    args = ap.parse_args()
    print("| model | SoC | tokens | ours tok/s | NPU / CPU ms | NPU bubbles | J | the longer lane: its biggest parts "
          "| genie predicted | genie published |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, shape in MODELS.items():
        config = model_config(f"random:{shape}")
        for soc in args.socs:
            scn = prepare(f"random:{shape}", PROGRAMS["ours"].chunk, placement=args.placement, progress=False, soc=soc)
            for length in args.lengths:
                r = simulate_prefill(scn, soc, length, ("ooo",))
                ooo, lanes = r["policies"]["ooo"], r["lanes"]
                lane = "cpu" if ooo["cpu_busy_s"] >= ooo["npu_busy_s"] else "npu"
                parts = sorted(lanes[lane].items(), key=lambda kv: -kv[1])[:2]
                total = sum(lanes[lane].values())
                what = f"{lane.upper()}: " + ", ".join(f"{k} {v / total:.0%}" for k, v in parts)
                peer = predict(config, PROGRAMS["genie"], load_device(soc), length, length)
                pub = published(shape, soc, length)
                print(f"| {name} | {soc} | {length:,} | {ooo['tok_s']:,.0f} | {1e3 * ooo['npu_busy_s']:,.0f} / "
                      f"{1e3 * ooo['cpu_busy_s']:,.0f} | {ooo['npu_bubble_rate']:.0%} | {ooo['energy_j']:.2f} | {what} "
                      f"| {peer['tok_s']:,.0f} | {f'{pub:,.0f}' if pub else '-'} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
