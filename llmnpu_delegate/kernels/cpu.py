"""The CPU as the INT8 chooser sees it: a plain value read from /proc/cpuinfo and the environment.

Apart from ``int8_path`` so that the native kernels' loader (which checks its build against this
CPU) and the chooser (which asks whether the native kernels loaded) both read it without importing
each other.
"""
from __future__ import annotations

import os
import platform
from dataclasses import dataclass

from ..errors import LlmNpuError


@dataclass(frozen=True)
class Cpu:
    """What the chooser needs to know of a CPU: a plain value, so tests can describe any CPU."""
    arch: str                    # platform.machine(): "x86_64", "aarch64", ...
    flags: frozenset[str]        # /proc/cpuinfo flags (x86) or features (Arm)
    model: str = ""
    onednn_cap: str = ""         # ONEDNN_MAX_CPU_ISA, upper case, "" when unset
    fbgemm_cap: str = ""         # FBGEMM_ENABLE_INSTRUCTIONS, upper case, "" when unset

    @property
    def x86(self) -> bool:
        return self.arch in ("x86_64", "AMD64", "i686")

    def has(self, *flags: str) -> bool:
        return all(f in self.flags for f in flags)


# LLMNPU_CPU_ISA=avx2 makes this process treat the CPU as an AVX2-only one (AMD Zen 2/3, Intel before
# Ice Lake): every feature above AVX2 is dropped from what ``detect`` reports. `make test-avx2` sets
# it, with oneDNN, fbgemm, MKL and torch capped alike, so one machine can test the other's paths.
_ABOVE_AVX2 = ("avx512", "avx_vnni", "avx10", "amx")


def detect() -> Cpu:
    """This machine's CPU, read from /proc/cpuinfo (Linux) and the environment."""
    flags: set[str] = set()
    model = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip().lower()
                if key in ("flags", "features") and not flags:
                    flags = set(value.split())
                elif key in ("model name", "cpu model") and value.strip():
                    model = value.strip()
    except OSError:
        pass
    emulate = os.environ.get("LLMNPU_CPU_ISA", "").strip().lower()
    if emulate == "avx2":
        flags = {f for f in flags if not f.startswith(_ABOVE_AVX2)}
    elif emulate:
        raise LlmNpuError(f"LLMNPU_CPU_ISA={emulate} is not an ISA class this project emulates: use avx2, or unset it")
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or ""
    return Cpu(platform.machine(), frozenset(flags), model, cap.strip().upper(),
               os.environ.get("FBGEMM_ENABLE_INSTRUCTIONS", "").strip().upper())
