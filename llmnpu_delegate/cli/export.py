"""``llmnpu export``."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from .. import backends
from ..backends.qnn import DEFAULT_SOC
from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..fanout import Failure, Job, as_dicts, run_jobs
from ..format.sidecar import ATTENTION_REGION, NORM_REGION
from ..lower.export_config import DEFAULT_CONTEXT, RESIDUAL_BITS, ExportConfig
from ..lower.graph_methods import check_program_placement
from ..lower.lowering_pool import default_workers
from ..lower.npu_subgraphs import FINE_BELOW_DB
from ..lower.pte import export_pte
from ..models import DEFAULT_MODEL, fp32_weight_bytes, job_memory
from ..backends import placements
from ..models import load_model
from ..partitioner.placement import AUTO, PAPER, parse_placement
from ..paths import cached_json
from ..prepare import qnn_holds
from ..quantize import QUANT_MODES, auto, quant_config
from ..runtime.engine import export_engine
from ..simulate.phone import choose_placement, choose_pruning
from ..simulate.programs import get_program
from ..text import calibration_ids
from .common import add_output_args, add_ray_args, pruning_rate, ray_line, ray_target


def add_parser(sub) -> None:
    p = sub.add_parser("export", help="write a deployable .pte (QNN/HTP or cpu-int8 NPU methods) and its sidecar",
                       description="Lower the partitioned chunk step into one ExecuTorch .pte: a method per static "
                                   "NPU subgraph (ExecuTorch's Qualcomm QNN delegate with our INT8 encodings, or "
                                   "XNNPACK INT8 for cpu-int8), a float method per CPU subgraph (portable kernels; "
                                   "attention with a symbolic past up to --context), and a sidecar JSON with what "
                                   "a runner needs (names, scales, thresholds, hot channels, pruned layers, profile).")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--backend", choices=list(backends.names()), default="qnn",
                   help="NPU backend the NPU methods are lowered for (default qnn)")
    p.add_argument("--soc", default=DEFAULT_SOC,
                   help=f"Snapdragon SoC for qnn (default {DEFAULT_SOC}, 8 Gen 3), or several joined by commas: a "
                        f"program each, named after --out with the SoC added (m.pte -> m-SM8650.pte)")
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--context", type=int, default=None,
                   help=f"longest prompt the .pte serves (default {DEFAULT_CONTEXT} or the model's context)")
    p.add_argument("--blocks", type=int, default=None, help="keep the first N decoder blocks (a quick check)")
    p.add_argument("--quant", choices=[m for m in QUANT_MODES if m != "fp32"], default="w8a8-shadow",
                   help="quantization (default w8a8-shadow)")
    p.add_argument("--pruning-rate", type=pruning_rate, default=None,
                   help="share of layers without a shadow path (w8a8-shadow): auto (default: priced on --soc's "
                        "device model for qnn, on this machine's engine for cpu-int8) or a share in [0, 1]")
    p.add_argument("--placement", default=None,
                   help="what the NPU methods hold beside the linears: paper (the linears only; the default for "
                        "cpu-int8); for --backend qnn also norms (each block norm at 16 bits with the linears it "
                        "feeds, one HTP graph) or auto (its default: of those, the one the phone model predicts the "
                        "shortest --context-token prefill for on --soc); for --backend cpu-int8 any placement the "
                        "engine runs but the +inline forms: norms, attention-half, block, or pieces joined by + "
                        "(llmnpu partition --placement P --why shows its cut)")
    p.add_argument("--shadow-branch", choices=["sparse", "dense"], default="sparse",
                   help="shadow outlier branches: sparse (default: hot channels' rows in the program, cold rows "
                        "in a file read when hit) or dense (the whole linear on the residue: a reference)")
    p.add_argument("--decode", choices=["int8", "fp32"], default="int8",
                   help="decode method on XNNPACK: int8 (default: INT8 weights, per-token dynamic activations) "
                        "or fp32 (the float reference)")
    p.add_argument("--output-bits", choices=["auto", "8", "32"], default="auto",
                   help="the NPU methods' outputs: 8 (requantized, as an integer NPU graph), 32 (float, the "
                        "engine's own numbers: cpu-int8 only) or auto (default: the backend's best, 32 for "
                        "cpu-int8, 8 for qnn)")
    p.add_argument("--fine-outputs", choices=["auto", "off"], default="auto",
                   help=f"8-bit outputs: auto (default) gives an output that one 8-bit encoding holds below "
                        f"{FINE_BELOW_DB:g} dB on calibration text a second, finer 8-bit encoding (that product "
                        f"computed twice, merged by the runner); off keeps one encoding per output")
    p.add_argument("--residual-bits", type=int, choices=RESIDUAL_BITS, default=8,
                   help="qnn: the outputs of the linears that write the residual stream (o_proj, down_proj): 8 "
                        "(default) or 16 (their input converted to 16 bits on the NPU, the same product, at the "
                        "matrix unit's 16-bit rate: closer to the float model, docs/results.md)")
    p.add_argument("--workers", type=int, default=None,
                   help="processes lowering methods side by side (default: one per core); the program is the "
                        "same for any number")
    p.add_argument("--out", required=True, help="the .pte to write (beside it: .json sidecar, .tokenizer/ folder, "
                                                "and .rows.bin cold shadow rows if the program does not hold them)")
    add_ray_args(p, "one export per SoC")
    add_output_args(p, "print the summary as JSON")
    p.set_defaults(func=cmd_export)


def cmd_export(args) -> dict:
    socs = [s.strip() for s in args.soc.split(",")]
    if not all(socs) or len(set(socs)) != len(socs):
        raise LlmNpuError(f"--soc takes SoC names joined by commas, each once: got '{args.soc}'")
    ray = ray_target(args)
    if len(socs) == 1 and ray is None:
        summary, args.text = export_one(args)
        return summary
    if not backends.get(args.backend).uses_soc:     # its pruning is priced on the exporting machine: this one
        raise LlmNpuError(f"--backend {args.backend} has no SoC to fan out over: drop --ray and give one --soc, or "
                          f"use --backend qnn for a program per SoC")
    for soc in socs:        # every SoC known before the first export starts
        ExportConfig(args.backend, soc)
    out = Path(args.out)
    one = {soc: argparse.Namespace(**{**vars(args), "soc": soc, "no_progress": True, "workers": args.workers or default_workers(),
                                      "out": str(out if len(socs) == 1 else out.with_name(f"{out.stem}-{soc}{out.suffix}"))})
           for soc in socs}
    memory = job_memory(fp32_weight_bytes(args.model))
    ran = run_jobs([Job(soc, export_one, (a,), a.workers, memory) for soc, a in one.items()], ray)
    programs = as_dicts({soc: r if isinstance(r, Failure) else r[0] for soc, r in ran.results.items()})
    lines = [f"{soc}: failed ({r.cause})" if isinstance(r, Failure) else r[1] for soc, r in ran.results.items()]
    args.failed = any(isinstance(r, Failure) for r in ran.results.values())
    args.text = "\n".join(lines + ([ray_line(ran.report(ray), len(socs), "exports")] if ray else []))
    return {"programs": programs, **({"ray": ran.report(ray)} if ray else {})}


def export_one(args) -> tuple[dict, str]:
    """One program, for the one SoC of ``args.soc``: (its summary, the lines the command prints)."""
    quant = quant_config(args.quant, args.pruning_rate)
    # checked before the model is loaded and planned
    config = ExportConfig(args.backend, args.soc, args.context, args.shadow_branch, args.decode,
                          None if args.output_bits == "auto" else int(args.output_bits), args.fine_outputs == "auto",
                          args.residual_bits)
    backend = backends.get(args.backend)
    placement, choice = program_placement(args, config)
    check_program_placement(parse_placement(placement), args.backend, config.bits)
    if backend.uses_soc and auto.is_auto(quant):    # pruned for the phone's schedule, not this machine's
        quant = dataclasses.replace(quant, pruning_target=args.soc)
    lm, engine = export_engine(args.model, args.chunk, quant, args.blocks, progress=not args.no_progress,
                               choose=choose_pruning, placement=placement)
    calib_ids = calibration_ids(lm, None)
    summary = export_pte(engine, args.out, calib_ids, config, model={"spec": args.model, "blocks": args.blocks},
                         tokenizer=lm.tokenizer, workers=args.workers, progress=not args.no_progress,
                         release_engine=True)
    chosen = ""
    if choice:
        summary["placement_choice"] = choice
        chosen = (f"placement chosen by the phone model ({args.soc}, a {args.context or DEFAULT_CONTEXT}-token prompt, "
                  f"ooo): " + ", ".join(f"{r['placement']} {r['tok_s']:,.0f} tok/s" for r in choice) + "\n")
    sh = summary["shadow"]
    flops, wbytes = sh["flops_per_chunk"], sh["program_weight_bytes"]
    stages = ", ".join(f"{k.replace('_', ' ')} {v:.0f}" for k, v in summary["stage_seconds"].items())
    held, rows_file = summary["rows_in_program"], summary["rows_linears"] - summary["rows_in_program"]
    cold = (f"; cold rows of {held} linears read from the program's own INT8 weights, of {rows_file} "
            f"from a rows file of {summary['rows_bytes'] / 2**20:.1f} MiB" if sh["form"] == "sparse" else "")
    soc = f" --soc {args.soc}" if backend.uses_soc else ""     # else the simulator's default phone
    fine = (f" ({summary['fine_outputs']} with a second encoding: +{100 * summary['fine_npu_share']:.1f} % NPU "
            f"work)" if summary["fine_outputs"] else "")
    wide = f" (16 bits for the {summary['wide_linears']} residual writers)" if summary["wide_linears"] else ""
    text = (f"wrote {summary['pte']} ({summary['pte_bytes'] / 2**20:.1f} MiB: {summary['npu_methods']} NPU "
            f"methods for {args.backend}{' ' + args.soc if backend.uses_soc else ''}, "
            f"{summary['cpu_methods']} CPU methods for {summary['cpu_subgraphs']} CPU subgraphs, "
            f"{summary['output_bits']}-bit outputs{wide}{fine}, decode {summary['decode']} on XNNPACK) and "
            f"{summary['sidecar']} ({summary['sidecar_bytes'] / 2**10:.0f} KiB); chunk {summary['chunk_len']}, "
            f"context {summary['context']} tokens, {summary['seconds']:.0f} s with {summary['workers']} "
            f"worker(s) (their seconds: {stages})\n"
            f"shadow branches ({sh['form']}, {sh['linears']} linears) per chunk: float work "
            f"{flops[sh['form']] / 1e6:.1f} MFLOP (dense {flops['dense'] / 1e6:.1f}), float rows in the program "
            f"{wbytes[sh['form']] / 2**20:.2f} MiB (dense {wbytes['dense'] / 2**20:.2f}){cold}\n"
            f"placement {summary['placement']}: {_holds(summary)} (the engine runs every placement: llmnpu run "
            f"--placement; their phone speed: llmnpu simulate --model {args.model}{soc})\n"
            f"{chosen}"
            f"check it: llmnpu validate --pte {summary['pte']}   generate: llmnpu run --pte {summary['pte']} --prompt ...")
    return summary, text


def program_placement(args, config: ExportConfig) -> tuple[str, list[dict]]:
    """``--placement`` as given (default: the paper's for cpu-int8, ``auto`` for qnn), or for ``auto``
    on a phone's backend the placement among those its program holds whose prefill of a --context
    token prompt the phone model predicts shortest on --soc, with one row per candidate (none when
    the model allows one only)."""
    backend = backends.get(args.backend)
    name = args.placement or (AUTO if backend.uses_soc else PAPER)
    if name != AUTO:
        return name, []
    if not backend.uses_soc:
        raise LlmNpuError(f"--placement {AUTO} chooses by a phone's predicted prefill, for --backend qnn: name a "
                          f"placement for {args.backend} (llmnpu run --placement auto times this machine's choice)")
    candidates = [p for p in placements(backend) if _writable(p, args.backend, config.bits)]
    lm = load_model(args.model)
    candidates = [p for p in candidates if qnn_holds(lm.model, p)]
    if len(candidates) == 1:        # nothing to choose between: no prediction to make
        return candidates[0], []
    prompt = args.context or DEFAULT_CONTEXT
    # the predictions partition the model once per candidate (minutes for a large one): kept per
    # model, phone, settings and code (``paths.cached_json``)
    program = get_program("ours-r16" if config.residual_bits == 16 else "ours")   # what the export writes
    key = {"model": lm.fingerprint, "soc": args.soc, "chunk": args.chunk, "prompt": prompt, "candidates": candidates,
           "quant": args.quant, "pruning_rate": args.pruning_rate, "program": program.name}
    rows = cached_json("phone-placement", key, lambda: choose_placement(
        args.model, args.chunk, args.soc, prompt, candidates, args.quant, args.pruning_rate, not args.no_progress,
        program=program)[1])
    return rows[0]["placement"], rows


def _writable(placement: str, target: str, bits: int) -> bool:
    try:
        check_program_placement(parse_placement(placement), target, bits)
    except LlmNpuError:
        return False
    return True


def _holds(summary: dict) -> str:
    graphs = summary["npu_graphs"]
    if not graphs:
        return "the NPU methods hold the linears only"
    if summary["target"] == "qnn":
        forms = summary["npu_forms"]
        kinds = [f"{n} {what}" for n, what in ((forms.get(NORM_REGION, 0), "a block norm at 16 bits with the 8-bit "
                                                "linears it feeds"),
                                               (forms.get(ATTENTION_REGION, 0), "RoPE and attention at 16 bits against "
                                                "a fixed K/V window, with the 8-bit linears they feed")) if n]
        peaks = (f" ({summary['peak_products']} of those linears with their shadow product over their peak "
                 f"channels, at 16 bits)" if summary.get("peak_products") else "")
        return (f"{graphs} of the {summary['npu_methods']} NPU methods hold more than linears, one HTP graph each: "
                f"{'; '.join(kinds)}{peaks}")
    return (f"{graphs} of the {summary['npu_methods']} NPU methods hold more than linears beside INT8 linears: "
            f"attention and norms at 16-bit NPU encodings, the rest in float")
