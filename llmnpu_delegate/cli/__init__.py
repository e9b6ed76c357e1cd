"""The ``llmnpu`` command line: one module per command, each with its options (``add_parser``), its
action and the formatter of its result beside it; ``common`` holds what they share."""
from __future__ import annotations

import argparse
import json
import os
import sys
from contextlib import contextmanager

from ..logs import quiet_third_party_logs

quiet_third_party_logs()     # before the commands import torchao and transformers, which log on import

from .. import __version__  # noqa: E402
from ..errors import LlmNpuError  # noqa: E402
from . import bench, calibrate, chat, eval, export, info, partition, prepare_text, run, simulate, validate  # noqa: E402

# in the order ``llmnpu --help`` lists them
COMMANDS = (run, chat, calibrate, eval, partition, bench, simulate, export, validate, info, prepare_text)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="llmnpu", description="Fast LLM prefill on phone NPUs (llm.npu) for PyTorch.",
        epilog="start with: llmnpu run --prompt 'What is a lighthouse?' --chat   "
               "(each command: llmnpu COMMAND --help)")
    ap.add_argument("--version", action="version", version=f"llmnpu_delegate {__version__}")
    sub = ap.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return ap


@contextmanager
def _native_output_to_stderr(active: bool):
    """While ``active``: what native libraries write to the process's stdout (the QNN libraries print
    a line as they load) goes to stderr, so that stdout holds the command's result alone."""
    if not active:
        yield
        return
    sys.stdout.flush()
    try:
        saved = os.dup(1)
        os.dup2(2, 1)
    except OSError:          # no stdout descriptor to move: nothing to keep clean
        yield
        return
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        # a command that streams to stdout as it goes (run, chat) keeps it unless asked for JSON
        with _native_output_to_stderr(bool(getattr(args, "json", False)) or not getattr(args, "streams", False)):
            result = args.func(args)
    except LlmNpuError as e:
        print(f"llmnpu: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    print(json.dumps(result, indent=1) if args.json or not hasattr(args, "text") else args.text)
    return 1 if getattr(args, "failed", False) else 0
