"""Driving the native runner (``runner/``, the ``llmnpu-runner`` binary) from Python: token ids in on
its standard input, token ids streamed back one per line, then one JSON line of timings; or, with
``NativeSession``, one long-lived ``--serve`` process answering prompt after prompt (a conversation)."""
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
from .sampling import GREEDY, Sampling

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
               sampling: Sampling = GREEDY, trace: str | Path | None = None, logits_out: str | Path | None = None,
               on_token: Callable[[int], None] | None = None, binary: Path | list[str] | None = None,
               extra: list[str] | None = None) -> NativeRun:
    """Generate with ``llmnpu-runner``; raises ``LlmNpuError`` with the binary's own one-line message.
    ``binary``: another build, or a command that runs one (another architecture's under an emulator)."""
    start = binary if isinstance(binary, list) else [str(binary or find_runner())]
    cmd = [*start, "--pte", str(pte), "--prompt-ids", "-", "--max-new-tokens", str(max_new_tokens), "--policy",
           policy, "--json", *sampling.native_args()]
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
        tokens, summary = _read_answer(proc.stdout, on_token)
        for _ in proc.stdout:        # nothing of ours follows the summary; drain what the runtime logs
            pass
        proc.wait()
        log.seek(0)
        err = log.read()
    if proc.returncode != 0:
        raise _failure(proc.returncode, err)
    if summary is None:
        raise LlmNpuError("native runner printed no summary line")
    return NativeRun(tokens, summary)


def _read_answer(lines, on_token: Callable[[int], None] | None) -> tuple[list[int], dict | None]:
    """One answer of the binary: its token ids, one per line (each handed to ``on_token`` as it comes),
    up to its JSON line (None if the output ends first). The runtime may log lines of its own: only
    ours are read."""
    tokens = []
    for line in lines:
        line = line.strip()
        if line.isdigit():
            tokens.append(int(line))
            if on_token:
                on_token(int(line))
        elif line.startswith('{"'):
            return tokens, json.loads(line)
    return tokens, None


def _failure(code: int, err: str) -> LlmNpuError:
    ours = [ln for ln in err.splitlines() if ln.startswith(f"{BINARY}: error: ")]
    message = ours[-1][len(f"{BINARY}: error: "):] if ours else f"exited with code {code}: {err[-500:]}"
    return LlmNpuError(f"native runner: {message}")


class NativeSession:
    """One ``llmnpu-runner --serve`` process for a conversation: it keeps the last prompt's K/V, so
    a prompt that starts like the last one prefills only the rest (``cached_tokens`` in its summary)."""

    def __init__(self, pte: str | Path, meta: dict, policy: str = "ooo", sampling: Sampling = GREEDY,
                 binary: Path | None = None, extra: list[str] | None = None):
        cmd = [str(binary or find_runner()), "--pte", str(pte), "--serve", "--policy", policy, *sampling.native_args()]
        self._log = tempfile.TemporaryFile("w+")      # stderr to a file (see run_native)
        self.proc = subprocess.Popen(cmd + (extra or []), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=runner_env(meta))

    def turn(self, ids: list[int], max_new_tokens: int, on_token: Callable[[int], None] | None = None,
             logits_out: str | Path | None = None) -> NativeRun:
        request = {"ids": [int(i) for i in ids], "max_new_tokens": int(max_new_tokens)}
        if logits_out is not None:
            request["logits_out"] = str(logits_out)
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            raise self._died() from None
        tokens, reply = _read_answer(self.proc.stdout, on_token)
        if reply is None:
            raise self._died()
        if "error" in reply:
            raise LlmNpuError(f"native runner: {reply['error']}")
        return NativeRun(tokens, reply)

    def _died(self) -> LlmNpuError:
        code = self.proc.wait()
        self._log.seek(0)
        return _failure(code, self._log.read())

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait()
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
