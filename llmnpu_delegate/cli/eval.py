"""``llmnpu eval``."""
from __future__ import annotations

import json

from ..errors import LlmNpuError
from ..evaluate import ALL_MODES, MODES, PROGRAM_MODE, check_modes, evaluate, sweep
from ..quantize import load_or_calibrate
from ..recipes import ET_CI_GATES
from ..text import calibration_ids, read_text, tokenize
from ..kernels.npu_attention import KV_BITS
from ..partitioner.placement import PAPER, parse_placement
from ..quantize.shadow_rows import PEAK_CHANNELS
from .common import add_model_args, add_ray_args, placement_arg, pruning_rate, ray_line, ray_target, setup


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="perplexity (or lm-eval tasks) of fp32 and each quantization mode",
                       description="Perplexity of the float model and of each W8A8 mode on held-out text; with "
                                   "--tasks, lm-evaluation-harness tasks instead (the offline llmnpu_offline "
                                   "tasks, built from the evaluation text, or your own with --include-path).")
    add_model_args(p)
    p.add_argument("--text-file", default=None, help="evaluation text (default: the shipped Wikipedia text); with --tasks, the "
                        "offline tasks are built from it")
    p.add_argument("--max-tokens", type=int, default=4096, help="tokens to evaluate (default 4096)")
    p.add_argument("--window", type=int, default=512, help="tokens per evaluation window (default 512)")
    p.add_argument("--modes", nargs="+", choices=list(ALL_MODES), default=None,
                   help=f"modes (default: fp32 and our quantization modes, and {PROGRAM_MODE} with --pte; "
                        "the et- modes, ExecuTorch's Qualcomm quantizer, when named)")
    p.add_argument("--pte", default=None,
                   help=f"an exported program (llmnpu export) whose numerics the {PROGRAM_MODE} mode computes: its "
                        "8-bit NPU output encodings, INT8 head and float16 table on the model (qnn, or cpu-int8 with "
                        "--output-bits 8)")
    p.add_argument("--clip-percentile", type=float, default=None, help="shadow clipping percentile (default 99.5)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None, help="pruning rate of pruned modes: auto (default: the paths whose time reaches this "
                        "machine's predicted prefill, within a KL budget on held-apart calibration text) or a "
                        "share in [0, 1]")
    p.add_argument("--importance", choices=["output", "ratio"], default=None,
                   help="layer ranking for pruning (default: output)")
    p.add_argument("--placement", nargs="+", type=placement_arg, default=None, metavar="PLACEMENT",
                   help="a row per placement for each quantization mode: paper (default: attention and norms on "
                        "the CPU in float), or one that puts attention or the norms on the NPU (norms, "
                        "attention-half, block, ...: at the NPU's 16-bit encodings; fused, or any with peak: the "
                        "norm readers' shadow products over their peak channels); the other pieces compute the "
                        "same wherever they run")
    p.add_argument("--npu-kv-bits", type=int, choices=KV_BITS, default=None,
                   help="bits of the K/V window of attention on the NPU (default 16)")
    p.add_argument("--sweep", action="store_true",
                   help="also print the trade-off curve over clipping percentiles and pruning rates (under each "
                        "--placement)")
    p.add_argument("--tasks", nargs="+", default=None,
                   help="lm-eval tasks instead of perplexity: llmnpu_offline (llmnpu_cloze, llmnpu_wikitext, "
                        "llmnpu_nextsentence) or any task lm-eval finds (needs the eval extra)")
    p.add_argument("--include-path", default=None, help="a folder of your own lm-eval task YAML files")
    p.add_argument("--limit", type=float, default=None,
                   help="with --tasks: documents per task (a count, or a share below 1; default all)")
    add_ray_args(p, "the modes (and --sweep's points)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_eval)


def cmd_eval(args) -> dict:
    if args.tasks is None and (args.include_path or args.limit is not None):
        raise LlmNpuError("--include-path and --limit go with --tasks")
    _modes(args, [])                    # a mode without its program, or the reverse: before the model loads
    placements = _placements(args)
    ray = ray_target(args)
    lm, calib_config = setup(args)
    overrides = {k: v for k, v in (("clip_percentile", args.clip_percentile),
                                   ("pruning_rate", args.pruning_rate),
                                   ("importance", args.importance)) if v is not None}
    if args.tasks is not None:
        return _cmd_tasks(args, lm, calib_config, overrides, ray, placements)
    eval_ids = tokenize(lm, read_text(args.text_file, "eval"))
    calib_ids = calibration_ids(lm, args.calib_text_file)
    modes = _modes(args, list(MODES))
    result = evaluate(lm, eval_ids, calib_ids, modes, args.window, args.max_tokens, calib_config,
                      overrides, progress=not args.no_progress, program=args.pte, ray=ray,
                      placements=placements, npu_kv_bits=args.npu_kv_bits or 16)
    if args.sweep:
        result["sweep"] = sweep(lm, eval_ids, calib_ids, args.window, args.max_tokens, calib_config,
                                progress=not args.no_progress, ray=ray, placements=placements,
                                npu_kv_bits=args.npu_kv_bits or 16)
    args.failed = any("error" in r for r in [*result["results"].values(), *result.get("sweep", [])])
    args.text = format_eval(result)
    return result


def _cmd_tasks(args, lm, calib_config, overrides, ray, placements) -> dict:
    from ..harness.suite import TABLE_MODES, format_table, run_tasks

    if args.sweep or args.max_tokens != 4096 or args.window != 512:
        raise LlmNpuError("--sweep, --max-tokens and --window are for perplexity, not --tasks")
    modes = _modes(args, list(TABLE_MODES))
    calib = None
    if any(MODES.get(m) is not None for m in modes):
        calib = load_or_calibrate(lm.model, calibration_ids(lm, args.calib_text_file), lm.fingerprint,
                                  calib_config, progress=not args.no_progress)
    limit = int(args.limit) if args.limit is not None and args.limit >= 1 else args.limit
    result = run_tasks(lm, args.tasks, modes, args.include_path, limit, overrides, calib,
                       text_file=args.text_file, progress=not args.no_progress, program=args.pte, ray=ray,
                       placements=placements, npu_kv_bits=args.npu_kv_bits or 16)
    args.failed = any("error" in r for r in result["results"].values())
    args.text = format_table(result) + ("\n" + ray_line(result["ray"], len(modes), "modes") if "ray" in result else "")
    return result


def _placements(args) -> list:
    """The placements asked for (the paper's by default); --npu-kv-bits only beside attention on the NPU."""
    placements = args.placement or [parse_placement(PAPER)]
    if args.npu_kv_bits is not None and not any(p.on_npu("attention") for p in placements):
        raise LlmNpuError("--npu-kv-bits sets the K/V window of attention on the NPU: give a --placement that puts "
                          "attention there (attention-half, block)")
    if args.placement and args.modes and not args.sweep and not any(MODES.get(m) is not None for m in args.modes):
        raise LlmNpuError(f"--placement applies to the quantization modes ({', '.join(m for m in MODES if MODES[m])}); "
                          f"--modes {' '.join(args.modes)} has none")
    return placements


def _modes(args, default: list[str]) -> list[str]:
    """The modes asked for; by default ``default``, and the program's mode when --pte gives one."""
    modes = args.modes or default + ([PROGRAM_MODE] if args.pte else [])
    check_modes(modes, args.pte)
    return modes


def _number(x: float) -> str:
    """Three decimals, or four significant digits where that would not fit its column (a broken
    mode's perplexity of 357,464 ran into the next one)."""
    return f"{x:.3f}" if abs(x) < 1e5 else f"{x:.4g}"


def format_eval(result: dict) -> str:
    lines = [f"model {result['model']}: perplexity on {result['tokens']} tokens, windows of {result['window']}"]
    base = result["results"].get("fp32", {}).get("ppl")
    gate = ET_CI_GATES.get(result["model"], {}).get("logits_sqnr_db")
    width = max([22, *(len(m) + 2 for m in result["results"])])
    lines.append(f"{'mode':<{width}}{'ppl':>11}{'vs fp32':>11}{'SQNR dB':>9}{'outliers':>10}")
    for mode, r in result["results"].items():
        if "error" in r:
            lines.append(f"{mode:<{width}}failed: {r['error']}")
            continue
        rel = _number(r["ppl"] / base) + "x" if base else ""
        frac = f"{100 * r['outlier_fraction']:.2f}%" if "outlier_fraction" in r else ""
        sqnr = f"{r['logits_sqnr_db']:.1f}" if "logits_sqnr_db" in r else ""
        mark = "" if gate is None or not sqnr else ("  meets" if r["logits_sqnr_db"] >= gate else "  below")
        lines.append(f"{mode:<{width}}{_number(r['ppl']):>11}{rel:>11}{sqnr:>9}{frac:>10}{mark}")
    lines.append("SQNR: the logits against fp32's over every window (ExecuTorch's sqnr_eval)"
                 + (f"; meets/below: ExecuTorch's CI floor for this model's QNN program, {gate:g} dB" if gate else ""))
    placed = [parse_placement(r["placement"]) for r in result["results"].values() if r.get("placement")]
    on_npu = [p for p in ("attention", "norms") if any(x.on_npu(p) for x in placed)]
    if on_npu:
        kv = {r["npu_kv_bits"] for r in result["results"].values() if "npu_kv_bits" in r}
        window = f", its K/V window at {kv.pop()} bits" if kv else ""
        lines.append(f"mode@placement: the mode with {' and '.join(on_npu)} on the NPU where the placement puts "
                     f"{'them' if len(on_npu) > 1 else 'it'}, at 16-bit encodings{window} (its other pieces compute "
                     f"as on the CPU)")
    if any(x.on_npu("peak") for x in placed):
        lines.append(f"peak: q/k/v's and gate/up's shadow products over their {PEAK_CHANNELS} peak input channels "
                     f"only, as an NPU graph would hold them (float outputs, as the cpu-int8 engine runs them)")
    lines += ["sweep " + json.dumps(row) for row in result.get("sweep", [])]
    if "ray" in result:
        lines.append(ray_line(result["ray"], len(result["results"]), "modes"))
    return "\n".join(lines)
