"""``llmnpu partition``."""
from __future__ import annotations

from ..chunk_step import DEFAULT_CHUNK
from ..errors import LlmNpuError
from ..partitioner.placement import PAPER, PIECES, PRESETS
from ..partitioner.report import format_summary, format_why, partition_summary
from ..prepare import default_calibration, plan_and_partition
from ..quantize import QUANT_MODES, resolve_quant
from ..simulate.phone import choose_pruning
from .common import add_model_args, placement_arg, setup


def add_parser(sub) -> None:
    p = sub.add_parser("partition", help="cut a chunk step into NPU/CPU subgraphs and print the table",
                       description="Export one prefill chunk step, partition it into NPU (INT8 linears) and CPU "
                                   "(float) subgraphs, and print counts, sharing, NPU FLOP share and memory "
                                   "against one graph set per chunk position.")
    add_model_args(p)
    p.add_argument("--chunk", type=int, default=DEFAULT_CHUNK, help=f"chunk length (default {DEFAULT_CHUNK})")
    p.add_argument("--prompt-len", type=int, default=1024, help="prompt length for FLOPs and memory (default 1024)")
    p.add_argument("--quant", choices=list(QUANT_MODES), default="w8a8-shadow",
                   help="quantization mode (default w8a8-shadow: shadow paths where calibration keeps them)")
    p.add_argument("--placement", type=placement_arg, default=PAPER,
                   help=f"what runs on the NPU beside the linears: {', '.join(PRESETS)} (default {PAPER}: linears "
                        f"only), or pieces joined by '+' from {', '.join(PIECES)}; '+inline' puts each shadow product in the "
                        f"CPU subgraph that merges it")
    p.add_argument("--why", action="store_true", help="say why each node on the CPU is not on the NPU")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_partition)


def cmd_partition(args) -> dict:
    lm, calib_config = setup(args)
    if args.prompt_len < 1:
        raise LlmNpuError(f"--prompt-len must be positive, got {args.prompt_len}")
    quant = resolve_quant(args.quant)
    calib = (default_calibration(lm, not args.no_progress, calib_config, args.calib_text_file)
             if quant is not None else None)
    choose_pruning(lm, calib, quant, not args.no_progress)    # an automatic rate: the host engine's choice
    _, partition = plan_and_partition(lm.model, lm, lm.fingerprint, args.chunk, quant, calib, args.placement,
                                      not args.no_progress)
    summary = partition_summary(partition, args.chunk, args.prompt_len, quantized=quant is not None)
    args.text = format_summary(lm.spec, summary)
    if args.why:
        summary["why"] = partition.why
        args.text += "\n" + format_why(partition.why)
    return {"model": lm.spec, "quant": args.quant, **summary}
