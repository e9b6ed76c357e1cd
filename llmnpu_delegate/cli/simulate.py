"""``llmnpu simulate``."""
from __future__ import annotations

from ..errors import LlmNpuError
from ..evaluate import SWEEP_PRUNING_RATES
from ..models import RANDOM_SHAPES
from ..prefill import DEFAULT_CHUNK
from ..runtime.executor import POLICIES
from ..simulate.device import load_device, socs
from ..simulate.paper import format_validation, validate
from ..simulate.phone import QUANT_MODES as SIM_QUANT
from ..simulate.phone import prepare, simulate_prefill, sweep
from .common import add_output_args, pruning_rate


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict phone prefill speed, bubbles and energy (discrete-event model)",
                       description="Simulate the chunked prefill on a Snapdragon SoC: the real partition, shadow "
                                   "plan and scheduler, each subgraph priced by a device profile fitted to the "
                                   "paper's micro-benchmarks. Nothing runs on a phone.")
    p.add_argument("--model", default="smollm2-135m",
                   help="smollm2-135m (default), a Hugging Face folder, or random:<shape> (shapes only; the "
                        f"paper's models: {', '.join(s for s in RANDOM_SHAPES if not s.startswith('tiny'))})")
    p.add_argument("--soc", default="SM8650", help=f"device profile: {', '.join(socs())} (default SM8650)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--past", type=int, default=0,
                   help="tokens before the prompt whose K/V are kept (a later turn of a conversation: the prompt "
                        "is its new tokens only; default 0)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--quant", choices=list(SIM_QUANT), default="w8a8-shadow", help="default w8a8-shadow")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None, help="share of linears without a shadow path (default auto)")
    p.add_argument("--norms", choices=["cpu", "npu"], default="cpu", help="where norms run (default cpu)")
    p.add_argument("--fine-share", type=float, default=0.0,
                   help="share of the NPU linears' outputs computed a second time for a finer 8-bit encoding "
                        "(llmnpu export prints it; default 0: one encoding each)")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                   help="scheduling policies (default: all)")
    p.add_argument("--trace-dir", default=None, help="write Chrome/Perfetto traces and timeline PNGs here")
    p.add_argument("--sweep", action="store_true",
                   help="chunk length x pruning rate trade-off, with the embedded model's measured perplexity")
    p.add_argument("--validate", action="store_true", help="predictions beside the paper's published figures")
    add_output_args(p)
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> dict:
    load_device(args.soc)   # an unknown SoC fails before any model is loaded
    if args.past and (args.validate or args.sweep):
        raise LlmNpuError("--past predicts one later turn: drop it with --validate or --sweep")
    if args.validate:
        result = validate(args.soc, args.chunk, args.prompt_len, progress=not args.no_progress)
        args.text = format_validation(result)
        return result

    if args.sweep:
        rows = sweep(args.model, args.soc, args.prompt_len, SWEEP_PRUNING_RATES, progress=not args.no_progress)
        args.text = _format_sweep(args, rows)
        return {"model": args.model, "soc": args.soc, "prompt_len": args.prompt_len, "sweep": rows}
    scn = prepare(args.model, args.chunk, args.quant, args.pruning_rate, args.norms, progress=not args.no_progress,
                  soc=args.soc)
    result = simulate_prefill(scn, args.soc, args.prompt_len, tuple(args.policies), args.trace_dir, args.past,
                              args.fine_share)
    args.text = _format_simulate(result)
    return result


def _format_simulate(r: dict) -> str:
    after = f" after a kept past of {r['past']}" if r["past"] else ""
    lines = [f"{r['model']} on {r['soc']} ({r['device']}), simulated: {r['prompt_len']} tokens{after} in {r['chunks']} "
             f"chunks of {r['chunk']}, {r['subgraphs']} subgraphs, {r['shadowed_linears']} shadowed linears "
             f"(plan: {r['plan_source']})"
             + (f"; {100 * r['fine_share']:.1f} % of the NPU outputs computed twice for a second encoding"
                if r["fine_share"] else "")]
    lines.append(f"{'policy':<10}{'tok/s':>8}{'wall ms':>9}{'NPU ms':>8}{'CPU ms':>8}{'bubbles':>9}{'bound':>8}"
                 f"{'energy J':>10}{'tok/J':>7}")
    for p, d in r["policies"].items():
        lines.append(f"{p:<10}{d['tok_s']:>8.0f}{1e3 * d['wall_s']:>9.0f}{1e3 * d['npu_busy_s']:>8.0f}"
                     f"{1e3 * d['cpu_busy_s']:>8.0f}{100 * d['npu_bubble_rate']:>8.1f}%{d['bound_tok_s']:>8.0f}"
                     f"{d['energy_j']:>10.2f}{d['tokens_per_j']:>7.0f}")
    return "\n".join(lines)


def _format_sweep(args, rows: list[dict]) -> str:
    lines = [f"{args.model} on {args.soc}, {args.prompt_len} tokens, ooo: predicted tok/s by chunk and pruning rate; "
             f"perplexity measured on the embedded model at that rate"]
    chunks = sorted({r["chunk"] for r in rows})
    lines.append(f"{'pruning':>8}{'ppl':>8}" + "".join(f"{'C=' + str(c):>9}" for c in chunks))
    for rate in sorted({r["pruning_rate"] for r in rows}):
        rs = {r["chunk"]: r for r in rows if r["pruning_rate"] == rate}
        ppl = next(iter(rs.values()))["embedded_ppl"]
        lines.append(f"{rate:>8.0%}{ppl:>8.2f}" + "".join(f"{rs[c]['tok_s']:>9.0f}" for c in chunks))
    return "\n".join(lines)
