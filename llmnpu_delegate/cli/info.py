"""``llmnpu info``."""
from __future__ import annotations

from ..host_report import format_info, info
from .common import add_output_args


def add_parser(sub) -> None:
    p = sub.add_parser("info", help="this machine as the project sees it: CPU, INT8 kernel, native builds, QNN, cache",
                       description="One screen for bug reports: the CPU and its INT8 class, the INT8 kernel every "
                                   "NPU subgraph runs here (never one that saturates), decode's activation bits, "
                                   "whether the native kernels and runner are built (and for this CPU), Qualcomm's "
                                   "libraries, and the cache folder.")
    add_output_args(p)
    p.set_defaults(func=cmd_info)


def cmd_info(args) -> dict:
    result = info()
    args.text = format_info(result)
    return result
