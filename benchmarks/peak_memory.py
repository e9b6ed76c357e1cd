"""Peak memory of a command and every process it forks: the summed PSS of the process tree.

Usage: python benchmarks/peak_memory.py [--every 3] [--log FILE] -- COMMAND [ARGS...]
e.g.   python benchmarks/peak_memory.py -- llmnpu export --backend cpu-int8 --out smol.pte

``llmnpu export`` lowers methods in forked workers that share the parent's pages until they write
them, so one process's RSS says little and the sum of RSS counts the shared pages once per process.
PSS (proportional set size, ``/proc/PID/smaps_rollup``) splits each shared page among the processes
that map it, so the sum over the tree is what the tree holds. Sampled every ``--every`` seconds: a
peak shorter than that can be missed. Prints the peak summed PSS and RSS, the wall time and the
command's exit status; ``--log`` writes each sample (seconds, PSS MiB, RSS MiB, processes).
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as f:
                for child in f.read().split():
                    pids += _tree(int(child))
    except OSError:
        pass            # the process ended between two reads
    return pids


def _sample(pids: list[int]) -> tuple[int, int]:
    """(PSS, RSS) in KiB summed over ``pids``."""
    pss = rss = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Pss:"):
                        pss += int(line.split()[1])
                    elif line.startswith("Rss:"):
                        rss += int(line.split()[1])
        except OSError:
            pass
    return pss, rss


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--every", type=float, default=3.0, help="seconds between samples (default 3)")
    p.add_argument("--log", help="write every sample to this file")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command to run")
    args = p.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        p.error("give the command to measure after --")
    if not os.path.exists("/proc/self/smaps_rollup"):
        p.error("needs Linux's /proc/PID/smaps_rollup (kernel 4.14 or later)")
    t0 = time.time()
    child = subprocess.Popen(command)
    peak_pss = peak_rss = 0
    log = open(args.log, "w") if args.log else None
    try:
        while child.poll() is None:
            pids = _tree(child.pid)
            pss, rss = _sample(pids)
            peak_pss, peak_rss = max(peak_pss, pss), max(peak_rss, rss)
            if log:
                log.write(f"{time.time() - t0:.0f} {pss // 1024} {rss // 1024} {len(pids)}\n")
                log.flush()
            time.sleep(args.every)
    finally:
        if log:
            log.close()
    print(f"peak summed PSS {peak_pss / 2**20:.2f} GiB, peak summed RSS {peak_rss / 2**20:.2f} GiB, "
          f"wall {time.time() - t0:.0f} s, exit status {child.returncode}", file=sys.stderr)
    return child.returncode


if __name__ == "__main__":
    sys.exit(main())
