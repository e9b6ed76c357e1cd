"""Which INT8 GEMM runs on this CPU: the one place that decides it.

The contract of every INT8 linear here is the NPU's: the exact int32 sum of products of symmetric
int8 codes (|code| <= 127). Fast CPU kernels do not all keep it. Without VNNI (or AMX), oneDNN's and
fbgemm's u8 x s8 kernels multiply with ``vpmaddubsw``, which adds two u8 x s8 products into a
*saturating* int16: an all-127 row against an all-127 weight over K = 576 sums to 73,440 instead of
9,290,304. So a path is chosen from what the CPU has (and from the ISA caps oneDNN and fbgemm obey:
``ONEDNN_MAX_CPU_ISA``, ``FBGEMM_ENABLE_INSTRUCTIONS``), and a path that can saturate is never chosen.

Paths (``LLMNPU_INT8_KERNEL`` forces one; ``auto`` or unset chooses):

- ``onednn``: oneDNN's ``qlinear_pointwise`` (u8 activation with zero point 128, s8 weight). Exact only
  with ``vpdpbusd`` (AVX-512 VNNI, AVX-VNNI) or AMX tiles, which accumulate in int32.
- ``avx512`` / ``avx2``: ``kernels/native/int8_gemm.cpp``: codes widened to int16 and multiplied with
  ``vpmaddwd`` (two products summed straight into int32: nothing to saturate).
- ``portable``: the same native kernel as plain C++ loops with int32 sums (what aarch64 runs: the
  compiler's NEON code widens before it adds).
- ``int_mm``: ``torch._int_mm`` (s8 x s8 -> s32), which runs on oneDNN too: exact where oneDNN is
  (with oneDNN capped at AVX2 it returned sums off by millions).
- ``int64``: an int64 matmul: the slow reference that shares no code with the others, and the
  fallback where neither oneDNN nor the native kernels can be exact.

Decode's dynamic linear (one token, weights read once: bound by their bytes) is the native
``Int8Gemv`` (``kernels/native/int8_gemv.cpp``), exact in 8 bits on every path (``decode_path``):
``vnni`` (``vpdpbusd``), ``avx2`` (``vpmaddubsw`` on |x - 128| and sign-flipped weights: two products
of at most 128 * 127 fit int16), ``portable``. Without the native kernels decode falls back to
fbgemm's dynamic linear, exact only with AVX-512 VNNI; elsewhere that fallback quantizes activations
to 7 bits (``reduce_range``, PyTorch's own convention) so a pair of products fits int16.
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch

from ..errors import LlmNpuError
from .cpu import Cpu, detect  # noqa: F401 - part of this module's API
from .native_ops import native_available

DECODE_PATHS = ("vnni", "avx2", "portable")
PATHS = ("onednn", "avx512", "avx2", "portable", "int_mm", "int64")
NATIVE_PATHS = ("avx512", "avx2", "portable")
ENV = "LLMNPU_INT8_KERNEL"

# ONEDNN_MAX_CPU_ISA values under which oneDNN may still use an int32-accumulating instruction
# (unset means no cap). Any other cap (AVX2, AVX512_CORE, ...) forces the saturating kernels.
_ONEDNN_VNNI512 = {"", "ALL", "DEFAULT", "AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16",
                   "AVX10_1_512", "AVX512_CORE_AMX", "AVX10_1_512_AMX", "AVX512_CORE_AMX_FP16",
                   "AVX10_1_512_AMX_FP16"}
_ONEDNN_VNNI256 = {"", "ALL", "DEFAULT", "AVX2_VNNI", "AVX2_VNNI_2"}
# FBGEMM_ENABLE_INSTRUCTIONS values that leave fbgemm its VNNI kernels
_FBGEMM_VNNI = {"", "AVX512_E1", "AVX512_VNNI"}


def isa_class(cpu: Cpu) -> str:
    """A short name for the CPU's INT8 capability, for reports: amx, avx512-vnni, avx-vnni, avx512,
    avx2, aarch64-i8mm, aarch64-dotprod, aarch64 or baseline."""
    if cpu.x86:
        if cpu.has("amx_int8"):
            return "amx"
        if cpu.has("avx512_vnni"):
            return "avx512-vnni"
        if cpu.has("avx_vnni"):
            return "avx-vnni"
        if cpu.has("avx512bw"):
            return "avx512"
        if cpu.has("avx2"):
            return "avx2"
        return "baseline"
    if cpu.arch in ("aarch64", "arm64"):
        return "aarch64-i8mm" if cpu.has("i8mm") else "aarch64-dotprod" if cpu.has("asimddp") else "aarch64"
    return "baseline"


def onednn_exact(cpu: Cpu) -> bool:
    """Whether oneDNN's u8 x s8 linear accumulates in int32 here (VNNI or AMX reachable under its cap)."""
    if not cpu.x86:
        return False        # oneDNN's aarch64 INT8 kernels are not verified here: never chosen
    return ((cpu.has("avx512_vnni", "avx512bw") and cpu.onednn_cap in _ONEDNN_VNNI512)
            or (cpu.has("avx_vnni") and cpu.onednn_cap in _ONEDNN_VNNI256))


def fbgemm_exact(cpu: Cpu) -> bool:
    """Whether fbgemm's dynamic linear (decode) is exact on full 8-bit activations here."""
    return cpu.x86 and cpu.has("avx512_vnni", "avx512bw") and cpu.fbgemm_cap in _FBGEMM_VNNI


def exact_on(path: str, cpu: Cpu) -> bool:
    """Whether ``path`` keeps the contract on ``cpu`` (the native ones need their instructions)."""
    if path == "onednn":
        return onednn_exact(cpu)
    if path == "avx512":
        return cpu.x86 and cpu.has("avx512f", "avx512bw")
    if path == "avx2":
        return cpu.x86 and cpu.has("avx2")
    if path == "int_mm":
        return onednn_exact(cpu)
    return path in ("portable", "int64")


def choose(cpu: Cpu, native: bool, onednn: bool = True) -> str:
    """The fastest exact path for ``cpu``; ``native``: whether ``libllmnpu_kernels.so`` is loaded;
    ``onednn``: whether torch has oneDNN's quantized linear.

    Order, fastest first (per core, prefill shapes): oneDNN with VNNI/AMX (~400 GOPS on Zen 4), the
    native AVX-512 then AVX2 kernels, the native portable loops; without the native kernels on a CPU
    where oneDNN is not exact, int64 (slow, but never wrong)."""
    if onednn and onednn_exact(cpu):
        return "onednn"
    if native:
        for path in ("avx512", "avx2"):
            if exact_on(path, cpu):
                return path
        return "portable"
    return "int64"


_forced: list[str] = []     # innermost ``forced`` path last


@contextlib.contextmanager
def forced(path: str):
    """Within the block, INT8 linears built or called take ``path`` (checked as ``$LLMNPU_INT8_KERNEL``
    is). Tests use it to build a reference engine on the int64 path beside the real one."""
    if path not in PATHS:
        raise LlmNpuError(f"unknown INT8 kernel path '{path}': use one of {', '.join(PATHS)}")
    if not exact_on(path, detect()):
        raise LlmNpuError(f"the {path} INT8 path cannot run exactly on this CPU")
    _forced.append(path)
    try:
        yield path
    finally:
        _forced.pop()


def current() -> str:
    """The path INT8 linears take now: a ``forced`` block's, else the process's (``_process_path``)."""
    return _forced[-1] if _forced else _process_path()


@functools.cache
def _process_path() -> str:
    """``$LLMNPU_INT8_KERNEL`` if set (checked), else ``choose(detect(), ...)``."""
    cpu = detect()
    forced = os.environ.get(ENV, "").strip().lower()
    if forced in ("", "auto"):
        return choose(cpu, native_available(), _onednn_available())
    if forced not in PATHS:
        raise LlmNpuError(f"{ENV}={forced} is not an INT8 kernel: use auto or one of {', '.join(PATHS)}")
    if forced == "onednn" and not _onednn_available():
        raise LlmNpuError(f"{ENV}=onednn: this torch build has no oneDNN quantized linear; unset it")
    if forced in NATIVE_PATHS and not native_available():
        raise LlmNpuError(f"{ENV}={forced} needs the native kernels: build them with `make kernels`")
    if not exact_on(forced, cpu):
        why = ("it would saturate: oneDNN has no VNNI or AMX here" + (f" (ONEDNN_MAX_CPU_ISA={cpu.onednn_cap})"
               if cpu.onednn_cap else "")) if forced == "onednn" else f"this CPU ({isa_class(cpu)}) lacks its instructions"
        raise LlmNpuError(f"{ENV}={forced} cannot run exactly here, {why}: unset it or pick another path")
    return forced


def _onednn_available() -> bool:
    return hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


def decode_path(cpu: Cpu) -> str:
    """The native decode GEMV's path for ``cpu``: ``vnni`` (AVX-512 VNNI with VL), ``avx2``, else
    ``portable``. Every one is exact; they differ in speed only."""
    if cpu.x86 and cpu.has("avx512_vnni", "avx512vl"):
        return "vnni"
    if cpu.x86 and cpu.has("avx2"):
        return "avx2"
    return "portable"


@functools.cache
def decode_kernel() -> str:
    """What decode's dynamic linear runs in this process: ``native-<path>`` (``Int8Gemv``), else the
    fbgemm fallback: ``fbgemm`` where exact in 8 bits, ``fbgemm-7bit`` (``reduce_range``) elsewhere."""
    cpu = detect()
    if native_available():
        return f"native-{decode_path(cpu)}"
    return "fbgemm" if fbgemm_exact(cpu) else "fbgemm-7bit"


def decode_reduce_range() -> bool:
    """Whether decode's activations get 7 bits (only the fbgemm fallback on a CPU without VNNI)."""
    return decode_kernel() == "fbgemm-7bit"


def describe() -> dict:
    """The CPU and the chosen kernels, for bench JSON, CLI summaries and ``llmnpu info``."""
    cpu = detect()
    return {"cpu": cpu.model or cpu.arch, "isa": isa_class(cpu), "int8_kernel": current(),
            "decode_kernel": decode_kernel(), "decode_activation_bits": 7 if decode_reduce_range() else 8}
