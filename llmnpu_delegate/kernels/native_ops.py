"""Kernels compiled from ``kernels/native/`` (C++ against the torch wheel, ``make kernels``), for the
work torch ops cannot do at the right cost. Each has a torch-ops twin here with the same contract:
the reference of its parity test, and what runs when the library is not built.
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
from pathlib import Path

import torch
from torch import Tensor

from ..errors import LlmNpuError
from .cpu import detect

log = logging.getLogger(__name__)

LIBRARY = Path(__file__).resolve().parent / "native" / "build" / "libllmnpu_kernels.so"
_state: dict = {}


def _library_path() -> Path:
    given = os.environ.get("LLMNPU_KERNELS")
    return Path(given) if given else LIBRARY


def native_available() -> bool:
    """Whether ``libllmnpu_kernels.so`` is loaded (``$LLMNPU_KERNELS`` names another build;
    ``LLMNPU_KERNELS=off`` keeps the torch-ops twins, e.g. to compare)."""
    if "loaded" not in _state:
        given = os.environ.get("LLMNPU_KERNELS")
        if given == "off":
            _state["loaded"] = False
        else:
            path = _library_path()
            if given and not path.is_file():
                raise LlmNpuError(f"LLMNPU_KERNELS names {given}, which does not exist: build it with "
                                  "`make kernels`, or set LLMNPU_KERNELS=off")
            if path.is_file():
                missing = missing_build_features(path)
                if missing:
                    raise LlmNpuError(f"the native kernels in {path.parent} were built for a CPU with "
                                      f"{', '.join(missing)}, which this one lacks (it would die of an illegal "
                                      "instruction): rebuild them here with `make kernels`")
                torch.ops.load_library(str(path))
                _state["loaded"] = True
            else:
                log.warning("native kernels not built (%s): the shadow product, norms, rotary embedding and gated "
                            "activation run on torch ops and attention in fp32, all slower; build them with `make kernels`",
                            path)
                _state["loaded"] = False
    return _state["loaded"]


def missing_build_features(library: Path) -> list[str]:
    """The SIMD features the build of ``library`` assumed (``build-isa.txt`` beside it, written by its
    CMakeLists) that this CPU lacks; empty when it can run here, or when the build recorded none."""
    record = library.parent / "build-isa.txt"
    if not record.is_file():
        return []
    have = {f.replace("_", "").lower() for f in detect().flags}
    return [f.lower() for f in record.read_text().split() if f.replace("_", "").lower() not in have]


def library_digest() -> str:
    """What kernels run here: a hash of the loaded library's bytes, or ``"off"``. Task-time profiles
    are keyed on it: a rebuilt kernel (faster attention, say) must not be scheduled with old times."""
    if "digest" not in _state:
        if native_available():
            _state["digest"] = hashlib.sha256(_library_path().read_bytes()).hexdigest()[:16]
        else:
            _state["digest"] = "off"
    return _state["digest"]


def _c_function(name: str, argtypes: list, restype):
    """``name`` from the loaded library as a ctypes function (the GIL released while it runs), or None
    without the library or in a build older than the function."""
    fn = getattr(ctypes.CDLL(str(_library_path())), name, None) if native_available() else None
    if fn is not None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def spin_wait():
    """``llmnpu_spin_wait(word, seen, max_ns, help)`` from the library, a ctypes function that waits for
    the int64 at ``word`` to differ from ``seen`` with the GIL released, spinning for at most ``max_ns``;
    it returns the last value read. With ``help=1`` it runs pieces of the native INT8 kernels another
    thread shares meanwhile (``lane_help.h``). None without the library (callers then block at once)."""
    if "spin_wait" not in _state:
        _state["spin_wait"] = _c_function("llmnpu_spin_wait", [ctypes.POINTER(ctypes.c_int64), ctypes.c_int64,
                                                               ctypes.c_int64, ctypes.c_int], ctypes.c_int64)
    return _state["spin_wait"]


def pieces_helped() -> int:
    """Pieces of shared native kernels that a waiting helper (``spin_wait(..., help=1)``) has run since
    the library was loaded; 0 without the library."""
    if "pieces_helped" not in _state:
        _state["pieces_helped"] = _c_function("llmnpu_pieces_helped", [], ctypes.c_int64)
    fn = _state["pieces_helped"]
    return int(fn()) if fn is not None else 0


def bf16_attention_available() -> bool:
    """Whether ``chunk_attention_bf16`` can run: the library is loaded and this CPU (and the build) has
    AVX-512 BF16."""
    if "bf16_attention" not in _state:
        _state["bf16_attention"] = native_available() and bool(torch.ops.llmnpu_native.bf16_attention_supported())
    return _state["bf16_attention"]


def chunk_attention_bf16(q: Tensor, k: Tensor, v: Tensor, mask: Tensor, scaling: float) -> Tensor:
    """One chunk's attention with bf16 operands (q * scaling, k, v and the softmax numerators) and fp32
    accumulation, scores and softmax: q [1, H, C, d], k/v [1, KV, L, d], ``mask`` one [C, L] matrix
    (bool: attend, or additive float) -> [1, C, H, d]. Native only (``bf16_attention_available``)."""
    if not bf16_attention_available():
        raise LlmNpuError("bf16 attention needs the native kernels built on a CPU with AVX-512 BF16 (`make kernels` "
                          "there); use fp32 attention on this one")
    return torch.ops.llmnpu_native.chunk_attention_bf16(q, k, v, mask, scaling)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``weight * (x * rsqrt(mean(x^2, -1) + eps))`` in fp32, the llama-family RMSNorm, as one op."""
    if native_available():
        return torch.ops.llmnpu_native.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def rms_norm_reference(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def add_rms_norm(x: Tensor, y: Tensor, z: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The residual add and the norm after it: ``s = x + (y + z)`` (``z`` optional, or one value: the
    shadow delta) and ``rms_norm(s)``, as ``(s, normed)``; each sum rounds as the aten adds do."""
    if native_available():
        return torch.ops.llmnpu_native.add_rms_norm(x, y, z, weight, eps)
    s = x + (y if z is None else y + z)
    return s, rms_norm(s, weight, eps)


def rope(x: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None = None) -> Tensor:
    """The rotate-half rotary embedding ``x * cos + rotate_half(x) * sin`` of ``x`` [B, H, C, d] (any
    strides), ``cos``/``sin`` holding one [d] row per position; with ``past`` [B, H, P, d] the result
    is ``cat([past, rotated], -2)``. Contiguous [B, H, P + C, d], bit-identical to the torch ops."""
    if native_available():
        return torch.ops.llmnpu_native.rope(x, cos, sin, past)
    return rope_reference(x, cos, sin, past)


def rope_reference(x: Tensor, cos: Tensor, sin: Tensor, past: Tensor | None = None) -> Tensor:
    half = x.shape[-1] // 2
    shape = (x.shape[-2], x.shape[-1])
    rotated = x * cos.reshape(shape) + torch.cat([-x[..., half:], x[..., :half]], -1) * sin.reshape(shape)
    return rotated.contiguous() if past is None else torch.cat([past, rotated], -2)


def linear_bf16w(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` for fp32 ``x`` and a bf16 ``weight`` [N, K], with fp32 products and
    sums: the only difference from the fp32 linear is the weight's rounding to bf16. Native: made
    for a few rows (the LM head on the prompt's last token), streaming half the bytes."""
    if native_available():
        return torch.ops.llmnpu_native.linear_bf16w(x, weight, bias)
    return torch.nn.functional.linear(x, weight.float(), bias)


def silu_mul_(gate: Tensor, up: Tensor) -> Tensor:
    """``gate = silu(gate) * up`` in place (the gated MLP's activation), in one pass when native."""
    if native_available() and gate.is_contiguous():
        return torch.ops.llmnpu_native.silu_mul_(gate, up)
    return torch.nn.functional.silu(gate, inplace=True).mul_(up)
