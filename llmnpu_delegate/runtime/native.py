"""Driving the native runner (``runner/``, the ``llmnpu-runner`` binary) from Python: token ids in on
its standard input, token ids streamed back one per line, then one JSON line of timings."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .. import backends
from ..errors import LlmNpuError

BINARY = "llmnpu-runner"
_REPO_BUILD = Path(__file__).resolve().parents[2] / "runner" / "build" / BINARY


def find_runner() -> Path:
    """``$LLMNPU_RUNNER``, else the repository's build (``make runner``), else ``llmnpu-runner`` on PATH."""
    given = os.environ.get("LLMNPU_RUNNER")
    if given:
        if not Path(given).is_file():
            raise LlmNpuError(f"LLMNPU_RUNNER names {given}, which does not exist: build it with `make runner`")
        return Path(given)
    if _REPO_BUILD.is_file():
        return _REPO_BUILD
    found = shutil.which(BINARY)
    if found:
        return Path(found)
    raise LlmNpuError(f"the native runner is not built: run `make runner` in the repository (it builds "
                      f"{_REPO_BUILD.relative_to(_REPO_BUILD.parents[2])}) or set LLMNPU_RUNNER")


def runner_env(meta: dict) -> dict:
    """The environment the binary needs: its backend's (for a QNN program, Qualcomm's libraries)."""
    return {**os.environ, **backends.get(meta["target"]).native_env()}


@dataclass
class NativeRun:
    tokens: list[int]
    summary: dict          # the binary's --json line


def run_native(pte: str | Path, ids: list[int], meta: dict, max_new_tokens: int, policy: str = "ooo",
               temperature: float | None = None, top_p: float = 1.0, seed: int | None = None,
               trace: str | Path | None = None, logits_out: str | Path | None = None,
               on_token: Callable[[int], None] | None = None, binary: Path | None = None,
               extra: list[str] | None = None) -> NativeRun:
    """Generate with ``llmnpu-runner``; raises ``LlmNpuError`` with the binary's own one-line message."""
    cmd = [str(binary or find_runner()), "--pte", str(pte), "--prompt-ids", "-", "--max-new-tokens",
           str(max_new_tokens), "--policy", policy, "--json"]
    if temperature is not None:
        cmd += ["--temperature", repr(float(temperature)), "--top-p", repr(float(top_p))]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if trace is not None:
        cmd += ["--trace", str(trace)]
    if logits_out is not None:
        cmd += ["--logits-out", str(logits_out)]
    cmd += extra or []
    # stderr to a file, not a pipe: the runtime's logs (QNN's are many) would fill a pipe that nobody
    # reads while the tokens are streamed, and block the binary
    with tempfile.TemporaryFile("w+") as log:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True,
                                env=runner_env(meta))
        proc.stdin.write(" ".join(map(str, ids)))
        proc.stdin.close()
        tokens, summary = [], None
        for line in proc.stdout:     # the runtime may log its own lines too: take ours only
            line = line.strip()
            if line.isdigit():
                tokens.append(int(line))
                if on_token:
                    on_token(int(line))
            elif line.startswith('{"'):
                summary = json.loads(line)
        proc.wait()
        log.seek(0)
        err = log.read()
    if proc.returncode != 0:
        ours = [ln for ln in err.splitlines() if ln.startswith(f"{BINARY}: error: ")]
        message = ours[-1][len(f"{BINARY}: error: "):] if ours else f"exited with code {proc.returncode}: {err[-500:]}"
        raise LlmNpuError(f"native runner: {message}")
    if summary is None:
        raise LlmNpuError("native runner printed no summary line")
    return NativeRun(tokens, summary)
