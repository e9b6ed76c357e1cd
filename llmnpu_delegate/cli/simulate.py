"""``llmnpu simulate``."""
from __future__ import annotations

import dataclasses
import math

from ..chunk_step import DEFAULT_CHUNK
from .. import backends
from ..backends import placements
from ..errors import LlmNpuError
from ..partitioner.placement import AUTO, PAPER, PIECES, PRESETS, parse_placement
from ..evaluate import SWEEP_PRUNING_RATES
from ..models import DEFAULT_MODEL, RANDOM_SHAPES, model_config
from ..runtime.schedule import POLICIES
from ..simulate.device import ASSUMPTIONS, load_device, socs
from ..simulate.measured import validation
from ..simulate.paper import format_validation, validate
from ..simulate.phone import QUANT_MODES as SIM_QUANT, choose_placement, prepare, simulate_prefill, sweep
from ..simulate.programs import PROGRAMS, get_program
from ..simulate.whole_npu import predict
from .common import add_output_args, placement_or_auto, pruning_rate

PHONE_BACKEND = "qnn"       # whose pieces the automatic placement chooses among
PEER = "genie"              # the program a user would pick instead: ours is set beside it

# where `--validate` shows how an assumption moves our program's prediction
ASSUMPTION_PROBE = ("random:qwen3-1.7b", "SM8750", 1024)


def add_parser(sub) -> None:
    p = sub.add_parser("simulate", help="predict phone prefill speed, bubbles and energy (discrete-event model)",
                       description="Simulate the chunked prefill on a Snapdragon SoC: our program (the real partition, "
                                   "shadow plan and scheduler) or a program users pick instead, priced by a device "
                                   "profile calibrated on published phone measurements. Nothing runs on a phone. "
                                   "--quant, --pruning-rate, --placement, --fine-share, --policies, --past, --sweep "
                                   "and --trace-dir are of our program's schedule.")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default), a Hugging Face folder, or random:<shape> (shapes only, real ones: "
                        f"{', '.join(s for s in RANDOM_SHAPES if not s.startswith('tiny'))})")
    p.add_argument("--soc", default="SM8650", help=f"device profile: {', '.join(socs())} (default SM8650)")
    p.add_argument("--program", default="ours", choices=list(PROGRAMS),
                   help="the program the phone runs: " + "; ".join(f"{n}: {p.description}" for n, p in PROGRAMS.items())
                        + " (default ours)")
    p.add_argument("--context", type=int, default=None,
                   help="the K/V window of a fixed-window program (genie*): its exported context length "
                        "(default: the prompt length rounded up to a chunk)")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt tokens (default 1024)")
    p.add_argument("--past", type=int, default=0,
                   help="tokens before the prompt whose K/V are kept (a later turn of a conversation: the prompt "
                        "is its new tokens only; default 0)")
    p.add_argument("--chunk", type=int, default=None,
                   help=f"chunk length (default: the program's, {DEFAULT_CHUNK} for ours, 128 for genie)")
    p.add_argument("--quant", choices=list(SIM_QUANT), default="w8a8-shadow", help="default w8a8-shadow")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None, help="share of linears without a shadow path (default auto)")
    p.add_argument("--placement", type=placement_or_auto, default=AUTO,
                   help=f"what our program runs on the NPU beside the linears: {', '.join(PRESETS)}, or pieces "
                        f"joined by '+' from {', '.join(PIECES)}, either with '+inline' (shadow products in the CPU task that merges them); default {AUTO}: each placement the phone's "
                        f"backend ({PHONE_BACKEND}) runs, simulated with its own pruning, the fastest kept")
    p.add_argument("--fine-share", type=float, default=0.0,
                   help="share of the NPU linears' outputs computed a second time for a finer 8-bit encoding "
                        "(llmnpu export prints it; default 0: one encoding each)")
    p.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES),
                   help="scheduling policies (default: all)")
    p.add_argument("--trace-dir", default=None, help="write Chrome/Perfetto traces and timeline PNGs here")
    p.add_argument("--sweep", action="store_true",
                   help="chunk length x pruning rate trade-off, with the embedded model's measured perplexity")
    p.add_argument("--validate", action="store_true",
                   help="predictions beside every published measurement: the fit's training rows, the validation "
                        "rows it never saw (other SoCs, larger models, llama.cpp) and the paper's figures")
    add_output_args(p)
    p.set_defaults(func=cmd_simulate)


def cmd_simulate(args) -> dict:
    load_device(args.soc)   # an unknown SoC fails before any model is loaded
    args.program = get_program(args.program)
    if args.chunk is not None and args.chunk < 1:
        raise LlmNpuError(f"--chunk must be a positive number of rows, got {args.chunk}")
    if args.program.placement == "all" and args.chunk:
        args.program = dataclasses.replace(args.program, chunk=args.chunk)
    args.chunk = args.chunk or (args.program.chunk if args.program.placement == "linears" else DEFAULT_CHUNK)
    if args.past and (args.validate or args.sweep):
        raise LlmNpuError("--past predicts one later turn: drop it with --validate or --sweep")
    if args.validate:
        progress = not args.no_progress
        result = {"measured": validation(), "paper": validate("SM8650", args.chunk, args.prompt_len, progress=progress),
                  "assumptions": _assumption_ranges(progress)}
        args.text = "\n\n".join((_format_measured(result["measured"]), format_validation(result["paper"]),
                                 _format_assumptions(result["assumptions"])))
        return result
    if args.program.placement == "all":
        if args.sweep or args.past:
            raise LlmNpuError(f"--sweep and --past simulate our program's schedule: drop them with --program "
                              f"{args.program.name}")
        return _whole_npu(args)

    if args.sweep:
        placement = args.placement
        if placement == AUTO:       # the one a run of this model, SoC and prompt would choose
            placement = choose_placement(args.model, args.chunk, args.soc, args.prompt_len,
                                         placements(backends.get(PHONE_BACKEND)), args.quant, args.pruning_rate,
                                         not args.no_progress)[0].partition.placement
        rows = sweep(args.model, args.soc, args.prompt_len, SWEEP_PRUNING_RATES, progress=not args.no_progress,
                     placement=placement)
        args.text = _format_sweep(args, rows)
        return {"model": args.model, "soc": args.soc, "prompt_len": args.prompt_len, "sweep": rows}
    progress = not args.no_progress
    if args.placement == AUTO and args.program.rates == "paper":
        args.placement = PAPER      # the paper's implementation runs its own split
    choice = None
    if args.placement == AUTO:
        scn, choice = choose_placement(args.model, args.chunk, args.soc, args.prompt_len,
                                       placements(backends.get(PHONE_BACKEND)), args.quant, args.pruning_rate,
                                       progress, args.past, args.fine_share)
    else:
        if args.program.rates == "paper" and args.placement != parse_placement(PAPER):
            raise LlmNpuError("--program paper prices the paper's own split: drop --placement or use --placement paper")
        scn = prepare(args.model, args.chunk, args.quant, args.pruning_rate, args.placement, progress=progress,
                      soc=args.soc)
    result = simulate_prefill(scn, args.soc, args.prompt_len, tuple(args.policies), args.trace_dir, args.past,
                              args.fine_share, args.program)
    result["placement"] = scn.partition.placement.name
    if choice is not None:
        result["placement_choice"] = choice
    if not args.past:       # a fixed-window peer has no form of a later turn's past
        result["peer"] = _peer_prediction(args.model, args.soc, args.prompt_len)
    args.text = _format_simulate(result)
    return result


def _peer_prediction(model: str, soc: str, prompt_len: int) -> dict:
    """The peer program's prediction on the same model, SoC and prompt (its window: the prompt rounded
    up to its chunk), by the same device model."""
    program = get_program(PEER)
    return predict(model_config(model), program, load_device(soc), prompt_len, _window(program, prompt_len))


def _window(program, prompt_len: int) -> int:
    """A fixed-window program's default context: the prompt rounded up to its chunk."""
    return math.ceil(prompt_len / program.chunk) * program.chunk


def _whole_npu(args) -> dict:
    program = args.program
    context = args.context or _window(program, args.prompt_len)
    if args.prompt_len < 1 or context < args.prompt_len:
        raise LlmNpuError(f"--context {context} must hold the prompt of {args.prompt_len} tokens (and the prompt at least 1)")
    r = predict(model_config(args.model), program, load_device(args.soc), args.prompt_len, context)
    r.update(model=args.model, soc=args.soc, device=load_device(args.soc).name)
    by = r["seconds_by_kind"]
    lines = [f"{args.model} on {args.soc} ({r['device']}), simulated, program {program.name}: {args.prompt_len} tokens "
             f"in {r['chunks']} chunks of {r['chunk']} ({r['graphs_per_chunk']} graph executes each), "
             + (f"each against a fixed K/V window of {context}" if program.window == "fixed" else "each against its past"),
             f"{'tok/s':>8}{'wall ms':>9}{'NPU ms':>8}{'CPU ms':>8}{'energy J':>10}{'tok/J':>7}",
             f"{r['tok_s']:>8.0f}{1e3 * r['wall_s']:>9.0f}{1e3 * r['npu_busy_s']:>8.0f}{1e3 * r['cpu_busy_s']:>8.0f}"
             f"{r['energy_j']:>10.2f}{args.prompt_len / r['energy_j']:>7.0f}",
             "where the time goes: " + ", ".join(f"{k.replace('_', ' ')} {1e3 * v:.0f} ms" for k, v in
                                                  sorted(by.items(), key=lambda kv: -kv[1]) if v > 0)]
    args.text = "\n".join(lines)
    return r


def _assumption_ranges(progress: bool) -> list[dict]:
    """Our program's prediction at ASSUMPTION_PROBE across each assumption's plausible range."""
    model, soc, length = ASSUMPTION_PROBE
    scn = prepare(model, DEFAULT_CHUNK, pruning_rate=0.85, progress=progress, soc=soc)
    device = load_device(soc)
    out = []
    for name, (lo, hi) in ASSUMPTIONS.items():
        for value in (lo, (lo + hi) / 2, hi):
            r = simulate_prefill(scn, soc, length, ("ooo",), device=device.with_params({name: value}))
            d = r["policies"]["ooo"]
            out.append({"parameter": name, "value": value, "model": model, "soc": soc, "prompt_len": length,
                        "tok_s": d["tok_s"], "npu_busy_s": d["npu_busy_s"], "cpu_busy_s": d["cpu_busy_s"]})
    return out


def _format_measured(v: dict) -> str:
    lines = ["published prefill (Qualcomm AI Hub, qai-hub-models 0.65.0) against the model's prediction; "
             "training rows are marked *",
             f"{'':2}{'SoC':<8}{'model':<30}{'prec.':<7}{'runtime':<16}{'program':<17}{'ctx':>6}{'prompt':>7}"
             f"{'measured':>9}{'predicted':>10}{'error':>7}"]
    for r in sorted(v["rows"], key=lambda r: (not r["training"], r["soc"], r["program"], r["model_id"], r["context"])):
        lines.append(f"{'*' if r['training'] else '':2}{r['soc']:<8}{r['model_id'][:29]:<30}{r['precision']:<7}"
                     f"{r['runtime']:<16}{r['program']:<17}{r['context']:>6}{r['prompt_tokens']:>7}"
                     f"{r['measured_tok_s']:>9.0f}{r['predicted_tok_s']:>10.0f}{r['error']:>+7.0%}")
    for name, s in (("training", v["training_summary"]), ("validation", v["summary"])):
        lines.append(f"{name} rows: {s['rows']}, median |error| {s['median_abs_error']:.1%}, largest "
                     f"{s['max_abs_error']:.1%}, within +-25 %: {s['within_25']}")
    return "\n".join(lines)


def _format_assumptions(rows: list[dict]) -> str:
    lines = []
    for r in rows:
        lines.append(f"assumption {r['parameter']} = {r['value']:.2f}: ours, {r['model'].split(':')[-1]} on {r['soc']} "
                     f"at {r['prompt_len']} tokens, {r['tok_s']:.0f} tok/s (NPU {1e3 * r['npu_busy_s']:.0f} ms, "
                     f"CPU {1e3 * r['cpu_busy_s']:.0f} ms)")
    return "\n".join(lines)


def _format_simulate(r: dict) -> str:
    after = f" after a kept past of {r['past']}" if r["past"] else ""
    lines = []
    if "placement_choice" in r:
        lines.append("placement chosen by predicted ooo prefill (each with its own shadow pruning):")
        lines.append(f"  {'placement':<11}{'NPU graphs':>11}{'shadowed':>9}{'tok/s':>8}{'NPU ms':>8}{'CPU ms':>8}"
                     f"{'energy J':>10}")
        for c in r["placement_choice"]:
            lines.append(f"{'*' if c['placement'] == r['placement'] else ' '} {c['placement']:<11}{c['npu_graphs']:>11}"
                         f"{c['shadowed_linears']:>9}{c['tok_s']:>8.0f}{1e3 * c['npu_busy_s']:>8.0f}"
                         f"{1e3 * c['cpu_busy_s']:>8.0f}{c['energy_j']:>10.2f}")
    lines += [f"{r['model']} on {r['soc']} ({r['device']}), simulated, program {r['program']}, placement "
             f"{r['placement']}: {r['prompt_len']} tokens{after} in {r['chunks']} "
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
    lanes = r["lanes"]
    busy = {p: sum(lanes[p].values()) for p in lanes}
    for p in ("npu", "cpu"):
        parts = ", ".join(f"{k} {1e3 * v:.0f} ms" for k, v in sorted(lanes[p].items(), key=lambda kv: -kv[1]) if v > 0)
        lines.append(f"{p.upper()} lane {1e3 * busy[p]:.0f} ms: {parts}"
                     + (" (the longer lane: it bounds the prefill)" if busy[p] >= max(busy.values()) else ""))
    if "peer" in r and "ooo" in r["policies"]:
        peer, ours = r["peer"], r["policies"]["ooo"]
        lines.append(f"beside --program {peer['program']} on the same model and prompt: {peer['tok_s']:.0f} tok/s "
                     f"(NPU {1e3 * peer['npu_busy_s']:.0f} ms, CPU {1e3 * peer['cpu_busy_s']:.0f} ms, "
                     f"{peer['energy_j']:.2f} J); ours (ooo) {ours['tok_s'] / peer['tok_s']:.2f}x its speed, "
                     f"{ours['energy_j'] / peer['energy_j']:.2f}x its energy")
    return "\n".join(lines)


def _format_sweep(args, rows: list[dict]) -> str:
    lines = [f"{args.model} on {args.soc}, {args.prompt_len} tokens, placement {rows[0]['placement']}, ooo: predicted "
             f"tok/s by chunk and pruning rate; perplexity measured on the embedded model at that rate and placement"]
    chunks = sorted({r["chunk"] for r in rows})
    lines.append(f"{'pruning':>8}{'ppl':>8}" + "".join(f"{'C=' + str(c):>9}" for c in chunks))
    for rate in sorted({r["pruning_rate"] for r in rows}):
        rs = {r["chunk"]: r for r in rows if r["pruning_rate"] == rate}
        ppl = next(iter(rs.values()))["embedded_ppl"]
        lines.append(f"{rate:>8.0%}{ppl:>8.2f}" + "".join(f"{rs[c]['tok_s']:>9.0f}" for c in chunks))
    return "\n".join(lines)
