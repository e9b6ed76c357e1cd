"""What the commands share: model and output options, set-up, prompt reading."""
from __future__ import annotations

import argparse
from pathlib import Path

import torch

from ..errors import LlmNpuError
from ..fanout import LOCAL, check_ray
from ..logs import hide_progress_bars
from ..models import DEFAULT_MODEL, load_model
from ..partitioner.placement import AUTO, parse_placement
from ..quantize import CalibConfig
from ..runtime.sampling import Sampling


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"{DEFAULT_MODEL} (default), a Hugging Face folder, a .gguf file or random:<shape>")
    p.add_argument("--calib-text-file", default=None,
                   help="calibration text (default: the shipped news text, disjoint from the evaluation text)")
    p.add_argument("--calib-samples", type=int, default=8, help="calibration sequences (default 8)")
    p.add_argument("--calib-tokens", type=int, default=512, help="tokens per calibration sequence (default 512)")
    p.add_argument("--calib-percentiles", type=float, nargs="+", default=None,
                   help="percentiles of |x| to record (default 99 99.5 99.9 99.99); clipping uses one of them")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")


def placement_arg(text: str):
    """argparse type of ``--placement``: a preset or pieces joined by '+', either with ``+inline``
    (one-line error otherwise)."""
    try:
        return parse_placement(text)
    except LlmNpuError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


PLACEMENT_HELP = ("what the NPU regions run beside the linears: auto (default: the fastest on this machine, "
                  "chosen once by timing each preset's prefill and cached with the calibration), paper, norms, "
                  "attention-half, block, fused (block, and q/k/v's and gate/up's shadow products over their peak "
                  "channels in the NPU graphs), or pieces joined by '+'; '+inline' (paper+inline) runs each shadow "
                  "product in the task that adds it to its linear's output, in place, not beside the linear")


def placement_or_auto(text: str):
    """``--placement`` where the target may choose: ``auto`` or as ``placement_arg``."""
    return AUTO if text == AUTO else placement_arg(text)


def add_ray_args(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument("--ray", action="store_true",
                   help=f"run {what} as Ray tasks on a Ray instance started on this machine for this run (the ray "
                        "extra); results as without Ray, a failed one reported and the others kept")
    p.add_argument("--ray-address", default=None, metavar="ADDR",
                   help="as --ray, on the running Ray cluster at ADDR (host:port of its head; every node needs this "
                        "package and the same model files)")


def ray_target(args) -> str | None:
    """What ``--ray`` and ``--ray-address`` ask for: None (no Ray), ``fanout.LOCAL`` or the address."""
    target = args.ray_address or (LOCAL if args.ray else None)
    if target is not None:
        check_ray(target)
    return target


def ray_line(report: dict, jobs: int, what: str) -> str:
    """One line on a sweep's run on Ray: where, on how many nodes, how long."""
    where = "a local Ray instance" if report["address"] == LOCAL else f"the Ray cluster at {report['address']}"
    return (f"{jobs} {what} as Ray tasks on {where}, {len(set(report['nodes'].values()))} node(s): "
            f"{report['seconds']:.0f} s")


def add_output_args(p: argparse.ArgumentParser, json_help: str = "print one JSON object") -> None:
    p.add_argument("--no-progress", action="store_true", help="hide progress bars")
    p.add_argument("--json", action="store_true", help=json_help)


def setup(args):
    if args.threads is not None:
        if args.threads < 1:
            raise LlmNpuError(f"--threads must be at least 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    if args.no_progress:
        hide_progress_bars()
    lm = load_model(args.model)
    extra = {"percentiles": tuple(args.calib_percentiles)} if args.calib_percentiles else {}
    calib_config = CalibConfig(samples=args.calib_samples, tokens=args.calib_tokens, **extra)
    return lm, calib_config


def pruning_rate(value: str):
    """``--pruning-rate``: "auto" or a share in [0, 1]."""
    if value == "auto":
        return value
    try:
        return float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 'auto' or a number in [0, 1], got '{value}'") from None


def sampling_of(args) -> Sampling:
    """``--temperature``, ``--top-p`` and ``--seed`` as one ``Sampling``; a bad value's error names its flag."""
    try:
        return Sampling(args.temperature, args.top_p, args.seed)
    except LlmNpuError as e:
        raise LlmNpuError(f"--{e}") from None


def read_prompt(args) -> str:
    if args.prompt_file is None:
        return args.prompt
    path = Path(args.prompt_file)
    if not path.is_file():
        raise LlmNpuError(f"prompt file {path} does not exist")
    return path.read_text(encoding="utf-8", errors="replace")


def machine_line(r: dict) -> str:
    m = r["machine"]
    return (f"on {m['cpu']} ({m['isa']}), INT8 kernel {m['int8_kernel']}, "
            f"decode {m.get('decode_kernel', 'fbgemm')} ({m['decode_activation_bits']}-bit activations)")
