"""The NPU-side arithmetic as custom ops.

Quantization is symmetric INT8 in [-127, 127] with one float scale per tensor (activations) and
one per output channel or per tensor (weights), as Qualcomm HTP runs it. ``quantize`` saturates,
so quantizing with scale ``t / 127`` *is* clipping at ``t``: the shadow path adds back what the
saturation removed.

The GEMM is a real integer GEMM with int32 accumulation. On x86 with VNNI we use oneDNN's
``qlinear_pointwise`` (u8 x s8 -> s32, scales and bias fused into the epilogue); a symmetric int8
activation ``q`` is fed to it as the unsigned ``q + 128`` with zero point 128, which is exact.
``torch._int_mm`` (s8 x s8 -> s32) is the portable fallback and the reference in tests.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch import Tensor

QMAX = 127  # symmetric int8: -128 is never produced, so -x quantizes to -q

_HAS_ONEDNN = hasattr(torch.ops, "onednn") and hasattr(torch.ops.onednn, "qlinear_pointwise")


# --------------------------------------------------------------------------- quantize / dequantize
@torch.library.custom_op("llmnpu::quantize", mutates_args=())
def quantize(x: Tensor, scale: float) -> Tensor:
    """float -> int8: round(x / scale) saturated to [-127, 127]."""
    y = torch.div(x, scale)
    y.round_().clamp_(-QMAX, QMAX)
    return y.to(torch.int8)


@quantize.register_fake
def _(x, scale):
    return torch.empty_like(x, dtype=torch.int8)


@torch.library.custom_op("llmnpu::dequantize", mutates_args=())
def dequantize(q: Tensor, scale: float) -> Tensor:
    return q.to(torch.float32) * scale


@dequantize.register_fake
def _(q, scale):
    return torch.empty_like(q, dtype=torch.float32)


# --------------------------------------------------------------------------- integer linear
_packed_cache: dict[int, tuple[weakref.ref, Tensor, Tensor]] = {}
_lock = threading.Lock()   # the two caches below are filled once, by one thread


def _onednn_weight(w_q: Tensor) -> tuple[Tensor, Tensor]:
    """oneDNN's packed copy of an int8 weight and its (zero) zero points, made once per weight
    tensor and reused.

    Quantized weights are immutable in this project: a tensor modified in place after its first
    use would keep its old packed copy (inference tensors carry no version counter to detect it).
    """
    key = id(w_q)
    hit = _packed_cache.get(key)
    if hit is not None and hit[0]() is w_q:
        return hit[1], hit[2]
    with _lock:
        hit = _packed_cache.get(key)
        if hit is not None and hit[0]() is w_q:
            return hit[1], hit[2]
        packed = torch.ops.onednn.qlinear_prepack(w_q, None)
        zero_points = torch.zeros(w_q.shape[0], dtype=torch.int64)
        _packed_cache[key] = (weakref.ref(w_q, lambda _r, k=key: _packed_cache.pop(k, None)), packed, zero_points)
    return packed, zero_points


def _int_mm_linear(x_q: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    acc = torch._int_mm(x_q, w_q.t())  # [M, N] int32, exact
    out = acc.to(torch.float32).mul_(w_scale * x_scale)
    if bias is not None:
        out.add_(bias)
    return out


def _onednn_linear(x_u8: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    return _qlinear(x_u8, x_scale, *_onednn_weight(w_q), w_scale, bias)


def _qlinear(x_u8: Tensor, x_scale: float, packed: Tensor, zero_points: Tensor, w_scale: Tensor,
             bias: Tensor | None) -> Tensor:
    """oneDNN's INT8 linear on a packed weight: uint8 input (zero point 128), float output."""
    return torch.ops.onednn.qlinear_pointwise.default(
        x_u8, x_scale, 128, packed, w_scale, zero_points, bias, 1.0, 0, torch.float32, "none", [], ""
    )


def _check_linear_args(x: Tensor, w_q: Tensor, w_scale: Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"expected a 2-D activation [M, K], got {tuple(x.shape)}")
    torch._check(w_q.dtype == torch.int8, lambda: f"weight must be int8, got {w_q.dtype}")
    torch._check(x.shape[1] == w_q.shape[1], lambda: f"K mismatch: x {tuple(x.shape)}, w {tuple(w_q.shape)}")
    torch._check(w_scale.shape == (w_q.shape[0],), lambda: "w_scale must have one entry per output channel")


@torch.library.custom_op("llmnpu::int8_linear", mutates_args=())
def int8_linear(x_q: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """int8 [M, K] x int8 [N, K]^T -> int32 accumulate -> float [M, N] (* x_scale * w_scale[n] + bias)."""
    _check_linear_args(x_q, w_q, w_scale)
    if _HAS_ONEDNN and x_q.device.type == "cpu":
        x_u8 = (x_q.to(torch.int16) + 128).to(torch.uint8)
        return _onednn_linear(x_u8, x_scale, w_q.contiguous(), w_scale.float().contiguous(), bias)
    return _int_mm_linear(x_q, x_scale, w_q, w_scale, bias)


@int8_linear.register_fake
def _(x_q, x_scale, w_q, w_scale, bias=None):
    return x_q.new_empty((x_q.shape[0], w_q.shape[0]), dtype=torch.float32)


def _quantize_u8_eager(x: Tensor, scale: Tensor | float) -> Tensor:
    # One float temporary: the quotient is rounded, saturated and shifted in place.
    y = torch.div(x, scale)
    return y.round_().clamp_(-QMAX, QMAX).add_(128).to(torch.uint8)


@torch.library.custom_op("llmnpu::w8a8_linear", mutates_args=())
def w8a8_linear(x: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """float [M, K] -> quantize (saturating, per-tensor) -> int8 GEMM -> float [M, N]; one fused op."""
    _check_linear_args(x, w_q, w_scale)
    if _HAS_ONEDNN and x.device.type == "cpu":
        x_u8 = _quantize_u8_eager(x, x_scale)
        return _onednn_linear(x_u8, x_scale, w_q.contiguous(), w_scale.float().contiguous(), bias)
    return _int_mm_linear(quantize(x, x_scale), x_scale, w_q, w_scale, bias)


@w8a8_linear.register_fake
def _(x, x_scale, w_q, w_scale, bias=None):
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=torch.float32)


def _quantize_u8_expr(x: Tensor, scale: Tensor) -> Tensor:
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX).add(128).to(torch.uint8)


_fused_quantize = None     # the inductor-compiled ``_quantize_u8_expr``, once it has worked
_fused_state = "untried"   # "untried" | "ok" | "failed"


def quantize_u8(x: Tensor, scale: float) -> Tensor:
    """Symmetric INT8 quantization shifted to uint8 (``q + 128``) for oneDNN, in one fused pass.

    The native op (``llmnpu_native::quantize_u8``) when the kernels are built: one pass, and the GIL
    released while it runs, which the other prefill worker needs. Else the same expression compiled
    by inductor (division kept, so bit-identical; compiled once per process with symbolic shapes),
    and if compilation is impossible here (no C++ compiler), the eager form: five passes over ``x``,
    524 us for 256x4864 on one core against 144 us compiled.
    """
    from . import native_ops      # here: native_ops imports this module
    if native_ops.native_available():
        return torch.ops.llmnpu_native.quantize_u8(x, float(scale))
    return quantize_u8_torch(x, scale)


def quantize_u8_torch(x: Tensor, scale: float) -> Tensor:
    """``quantize_u8`` on torch ops (inductor-compiled, else eager): the native op's twin."""
    global _fused_quantize, _fused_state
    s = torch.tensor(float(scale))
    if _fused_state == "untried":
        with _lock:
            if _fused_state == "untried":
                try:
                    fn = torch.compile(_quantize_u8_expr, dynamic=True, fullgraph=True)
                    if not torch.equal(fn(x, s), _quantize_u8_eager(x, s)):
                        raise RuntimeError("compiled quantization differs from the eager one")
                    _fused_quantize, _fused_state = fn, "ok"
                except Exception as e:  # noqa: BLE001 - any compiler failure means: stay eager
                    _fused_state = "failed"
                    warnings.warn(f"fused quantization unavailable, using the eager form: {e}", RuntimeWarning,
                                  stacklevel=2)
    if _fused_state == "ok":
        return _fused_quantize(x, s)
    return _quantize_u8_eager(x, s)


def w8a8_linears(x: Tensor, x_scale: float, weights: list[tuple[Tensor, Tensor, Tensor | None]]) -> list[Tensor]:
    """Several W8A8 linears reading one activation (q/k/v, gate/up): quantize it once, then one
    INT8 GEMM per ``(w_q, w_scale, bias)``. Eager helper of the INT8 engine, not a graph op."""
    for w_q, w_scale, _ in weights:
        _check_linear_args(x, w_q, w_scale)
    return W8A8Linears(weights)(x, x_scale)


class W8A8Linears:
    """``w8a8_linears`` with its weights checked and packed once: what an NPU region calls per task.
    A call only quantizes and multiplies. Per-call checks cost ~4 us a linear, with the GIL held,
    and the other prefill worker waits for the GIL at every hand-off."""

    def __init__(self, weights: list[tuple[Tensor, Tensor, Tensor | None]]):
        k = weights[0][0].shape[1] if weights else 0
        for w_q, w_scale, _ in weights:
            _check_linear_args(w_q.new_empty((0, k), dtype=torch.float32), w_q, w_scale)
        self.in_features = k
        self.source = list(weights)         # the (w_q, w_scale, bias) given, for inspection
        self.onednn = _HAS_ONEDNN and all(w.device.type == "cpu" for w, _, _ in weights)
        if self.onednn:
            self.weights = [(*_onednn_weight(w.contiguous()), s.float().contiguous(), b) for w, s, b in weights]
        else:
            self.weights = self.source

    def __call__(self, x: Tensor, x_scale: float) -> list[Tensor]:
        torch._check(x.dim() == 2 and x.shape[1] == self.in_features,
                     lambda: f"expected an activation [M, {self.in_features}], got {tuple(x.shape)}")
        if self.onednn:
            x_u8 = quantize_u8(x, x_scale)
            return [_qlinear(x_u8, x_scale, packed, zp, s, b) for packed, zp, s, b in self.weights]
        x_q = quantize(x, x_scale)
        return [_int_mm_linear(x_q, x_scale, w, s, b) for w, s, b in self.weights]


def int8_linear_reference(x_q: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The portable path (``torch._int_mm``), kept callable for parity tests."""
    return _int_mm_linear(x_q, x_scale, w_q, w_scale, bias)


# --------------------------------------------------------------------------- shadow outliers
@torch.library.custom_op("llmnpu::outlier_extract", mutates_args=())
def outlier_extract(x: Tensor, threshold: float) -> tuple[Tensor, Tensor]:
    """Compact the part of ``x`` [M, K] that saturation at ``threshold`` drops.

    Returns ``channels`` [k] (int64, sorted input channels with any |x| > threshold) and
    ``residue`` [M, k] = x - clip(x, -t, t) on those channels (zero elsewhere in the column).
    """
    # amax/amin over rows: vectorised column reductions, no |x| temporary (aminmax(dim=0) is ~8x slower)
    channels = torch.nonzero((x.amax(dim=0) > threshold) | (x.amin(dim=0) < -threshold)).flatten()
    cols = x.index_select(1, channels)
    return channels, cols - cols.clamp(-threshold, threshold)


@outlier_extract.register_fake
def _(x, threshold):
    k = torch.library.get_ctx().new_dynamic_size()
    return x.new_empty((k,), dtype=torch.int64), x.new_empty((x.shape[0], k))


def outlier_product(residue: Tensor, w_rows: Tensor, out: Tensor | None = None) -> Tensor:
    """``residue [M, k] @ w_rows [k, N]`` (added into ``out`` if given), sparse when that is faster.

    Outliers cluster in a few channels (a dense residue block: one small GEMM), but when they are
    scattered over many channels the block is mostly zeros and a sparse (CSR) product is ~5x faster.
    """
    sparse = residue.numel() and int(torch.count_nonzero(residue)) * 20 < residue.numel()
    with warnings.catch_warnings():  # "sparse CSR support is in beta": a notice, not a problem
        warnings.simplefilter("ignore", UserWarning)
        if sparse:
            residue = residue.to_sparse_csr()
        return torch.mm(residue, w_rows) if out is None else torch.addmm(out, residue, w_rows)


@torch.library.custom_op("llmnpu::outlier_compensate", mutates_args=())
def outlier_compensate(y: Tensor, residue: Tensor, w_rows: Tensor) -> Tensor:
    """y [M, N] + residue [M, k] @ w_rows [k, N]: the float shadow matmul merged into the NPU result."""
    return outlier_product(residue, w_rows, y)


@outlier_compensate.register_fake
def _(y, residue, w_rows):
    return torch.empty_like(y)


# --------------------------------------------------------------------------- decode: dynamic INT8 linear
def prepack_dynamic(w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None):
    """An INT8 weight [N, K] with per-output-channel scales, packed once for ``dynamic_linear``
    (fbgemm's layout: VNNI u8 x s8 with int32 accumulation on this CPU)."""
    with warnings.catch_warnings():   # qint8 tensor creation is deprecated; the packed weight is what we keep
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(w_q, w_scale.double(), torch.zeros_like(w_scale, dtype=torch.int64), 0)
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())


def dynamic_linear(x: Tensor, packed) -> Tensor:
    """float [M, K] -> per-row-block dynamic INT8 (each call's own range, asymmetric u8) x packed INT8
    weight -> int32 -> float [M, N]: one fused call, no float weight read. Decode calls it with M = 1,
    so the activation scale is the token's own."""
    return torch.ops.quantized.linear_dynamic(x, packed, False)


def dynamic_linear_reference(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """What ``dynamic_linear`` computes, in plain integer arithmetic (for parity tests): x quantized to
    u8 over [min(x, 0), max(x, 0)] with a zero point, exact int64 products, dequantized."""
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / 255 or 1.0
    zero = int(min(max(round(-lo / scale), 0), 255))
    x_q = torch.clamp(torch.round(x / scale) + zero, 0, 255).to(torch.int64)
    acc = (x_q - zero) @ w_q.to(torch.int64).t()
    out = acc.to(torch.float64) * (scale * w_scale.double())
    return (out if bias is None else out + bias.double()).float()
