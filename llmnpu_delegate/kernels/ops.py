"""The NPU-side arithmetic as custom ops.

Quantization is symmetric INT8 in [-127, 127] with one float scale per tensor (activations) and
one per output channel or per tensor (weights), as Qualcomm HTP runs it. ``quantize`` saturates,
so quantizing with scale ``t / 127`` *is* clipping at ``t``: the shadow path adds back what the
saturation removed.

The GEMM is a real integer GEMM: the exact int32 sum of the codes' products, on whichever kernel
``int8_path`` chooses for this CPU (never one that saturates). oneDNN's ``qlinear_pointwise`` and the
native kernels take the symmetric code ``q`` as the unsigned ``q + 128`` (zero point 128), which is
exact; the int64 path is the reference in tests.
"""
from __future__ import annotations

import threading
import warnings
import weakref

import torch
from torch import Tensor

from . import int8_path, native_ops
from .native_ops import native_available

QMAX = 127  # symmetric int8: -128 is never produced, so -x quantizes to -q

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
# Every INT8 GEMM goes through one of int8_path.PATHS, chosen once per process (int8_path.current()):
# each computes the exact int32 sum of the codes' products. Weights are packed for it once per tensor.
_packed_cache: dict[tuple[int, str], tuple[weakref.ref, object]] = {}
_lock = threading.Lock()   # the caches below are filled once, by one thread


def _pack(w_q: Tensor, path: str):
    """``w_q`` in the form ``path`` multiplies, made once per weight tensor and reused.

    Quantized weights are immutable in this project: a tensor modified in place after its first
    use would keep its old packed copy (inference tensors carry no version counter to detect it).
    """
    key = (id(w_q), path)
    hit = _packed_cache.get(key)
    if hit is not None and hit[0]() is w_q:
        return hit[1]
    with _lock:
        hit = _packed_cache.get(key)
        if hit is not None and hit[0]() is w_q:
            return hit[1]
        w = w_q.contiguous()
        if path == "onednn":
            packed = (torch.ops.onednn.qlinear_prepack(w, None), torch.zeros(w.shape[0], dtype=torch.int64))
        elif path in int8_path.NATIVE_PATHS:
            packed = torch.ops.llmnpu_native.int8_pack(w)
        else:
            packed = w
        # The cache holds its key by a weak reference: a value holding ``w_q`` itself (a contiguous
        # weight; oneDNN's prepacked form where it reorders nothing) would keep every weight ever
        # packed alive for good. Such a form costs nothing to make again, so it is not kept.
        if packed is w_q or (isinstance(packed, tuple) and packed[0] is w_q):
            return packed
        _packed_cache[key] = (weakref.ref(w_q, lambda _r, k=key, c=_packed_cache: c.pop(k, None)), packed)
    return packed


def _epilogue(acc: Tensor, x_scale: float, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    out = acc.to(torch.float32).mul_(w_scale * x_scale)
    return out if bias is None else out.add_(bias)


def _gemm(path: str, x: Tensor, x_scale: float, packed, n: int, w_scale: Tensor, bias: Tensor | None) -> Tensor:
    """One INT8 linear on ``path``: ``x`` is uint8 (codes + 128) for onednn and the native paths,
    int8 codes for int_mm and int64; ``packed`` comes from ``_pack``; float [M, N] out."""
    if path == "onednn":
        return torch.ops.onednn.qlinear_pointwise.default(
            x, x_scale, 128, packed[0], w_scale, packed[1], bias, 1.0, 0, torch.float32, "none", [], "")
    if path in int8_path.NATIVE_PATHS:
        return torch.ops.llmnpu_native.int8_gemm(x, x_scale, packed, n, w_scale, bias, path)
    if path == "int_mm":
        return _epilogue(torch._int_mm(x, packed.t()), x_scale, w_scale, bias)
    return _epilogue(x.long() @ packed.long().t(), x_scale, w_scale, bias)     # int64: the reference


def _wants_u8(path: str) -> bool:
    return path == "onednn" or path in int8_path.NATIVE_PATHS


def _check_linear_args(x: Tensor, w_q: Tensor, w_scale: Tensor) -> None:
    torch._check(x.dim() == 2, lambda: f"expected a 2-D activation [M, K], got {tuple(x.shape)}")
    torch._check(w_q.dtype == torch.int8, lambda: f"weight must be int8, got {w_q.dtype}")
    torch._check(x.shape[1] == w_q.shape[1], lambda: f"K mismatch: x {tuple(x.shape)}, w {tuple(w_q.shape)}")
    torch._check(w_scale.shape == (w_q.shape[0],), lambda: "w_scale must have one entry per output channel")


def _path_for(t: Tensor) -> str:
    return int8_path.current() if t.device.type == "cpu" else "int_mm"


@torch.library.custom_op("llmnpu::int8_linear", mutates_args=())
def int8_linear(x_q: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """int8 [M, K] x int8 [N, K]^T -> int32 accumulate -> float [M, N] (* x_scale * w_scale[n] + bias)."""
    _check_linear_args(x_q, w_q, w_scale)
    path = _path_for(x_q)
    x = (x_q.to(torch.int16) + 128).to(torch.uint8) if path == "onednn" else x_q
    return _gemm(path, x, x_scale, _pack(w_q, path), w_q.shape[0], w_scale.float().contiguous(), bias)


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
    return W8A8Linears([(w_q, w_scale, bias)], path=_path_for(x))(x, x_scale)[0]


@w8a8_linear.register_fake
def _(x, x_scale, w_q, w_scale, bias=None):
    return x.new_empty((x.shape[0], w_q.shape[0]), dtype=torch.float32)


def _quantize_u8_expr(x: Tensor, scale: Tensor) -> Tensor:
    return torch.clamp(torch.round(x / scale), -QMAX, QMAX).add(128).to(torch.uint8)


_fused_quantize = None     # the inductor-compiled ``_quantize_u8_expr``, once it has worked
_fused_state = "untried"   # "untried" | "ok" | "failed"


def quantize_u8(x: Tensor, scale: float) -> Tensor:
    """Symmetric INT8 quantization shifted to uint8 (``q + 128``) for oneDNN and the native GEMM, in one pass.

    The native op (``llmnpu_native::quantize_u8``) when the kernels are built: one pass, and the GIL
    released while it runs, which the other prefill worker needs. Else the same expression compiled
    by inductor (division kept, so bit-identical; compiled once per process with symbolic shapes),
    and if compilation is impossible here (no C++ compiler), the eager form: five passes over ``x``,
    524 us for 256x4864 on one core against 144 us compiled.
    """
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
    and the other prefill worker waits for the GIL at every hand-off.

    ``path``: one of ``int8_path.PATHS`` (default: this process's, ``int8_path.current()``)."""

    def __init__(self, weights: list[tuple[Tensor, Tensor, Tensor | None]], path: str | None = None):
        k = weights[0][0].shape[1] if weights else 0
        for w_q, w_scale, _ in weights:
            _check_linear_args(w_q.new_empty((0, k), dtype=torch.float32), w_q, w_scale)
        self.in_features = k
        self.source = list(weights)         # the (w_q, w_scale, bias) given, for inspection
        on_cpu = all(w.device.type == "cpu" for w, _, _ in weights)
        self.path = path or (int8_path.current() if on_cpu else "int_mm")
        self.weights = [(_pack(w, self.path), w.shape[0], s.float().contiguous(), b) for w, s, b in weights]

    def __call__(self, x: Tensor, x_scale: float) -> list[Tensor]:
        if x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(f"expected an activation [M, {self.in_features}], got {tuple(x.shape)}")
        xq = quantize_u8(x, x_scale) if _wants_u8(self.path) else quantize(x, x_scale)
        return [_gemm(self.path, xq, x_scale, packed, n, s, b) for packed, n, s, b in self.weights]


def int8_linear_reference(x_q: Tensor, x_scale: float, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None) -> Tensor:
    """The int64 path: plain integer arithmetic sharing no code with the fast kernels (parity tests)."""
    return _gemm("int64", x_q, x_scale, w_q, w_q.shape[0], w_scale.float(), bias)


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


def shadow_product(x: Tensor, threshold: float, hot: Tensor, cold: Tensor, slot: Tensor) -> tuple[Tensor, Tensor, int]:
    """The shadow branch of one linear: ``(x - clamp(x, -t, t)) @ W^T`` for ``x`` [M, K], with W^T's
    rows in two float tables: ``hot`` [h, N] (in RAM) and ``cold`` [c, N] (e.g. memory-mapped: only
    hit rows are read); ``slot`` [K] int64 maps channel k to hot row i >= 0 or to cold row -1 - slot[k].
    Returns the product [M, N], the hit input channels (sorted) and the number of outlier elements.
    Native: one scan of ``x`` and one row per outlier."""
    if native_available():
        return torch.ops.llmnpu_native.shadow_product(x, threshold, hot, cold, slot)
    return shadow_product_reference(x, threshold, hot, cold, slot)


def shadow_product_add_(y: Tensor, x: Tensor, threshold: float, hot: Tensor, cold: Tensor, slot: Tensor) -> tuple[Tensor, int]:
    """``y += shadow_product(x, ...)`` in place for a contiguous float ``y`` [M, N]: the shadow branch
    merged into its linear's output as it is computed (native: rows without an outlier are not
    touched, and no [M, N] product or add pass). Returns the hit input channels and the outlier count."""
    if native_available():
        return torch.ops.llmnpu_native.shadow_product_add_(y, x, threshold, hot, cold, slot)
    product, channels, outliers = shadow_product_reference(x, threshold, hot, cold, slot)
    y.add_(product)
    return channels, outliers


def shadow_product_reference(x: Tensor, threshold: float, hot: Tensor, cold: Tensor, slot: Tensor) -> tuple[Tensor, Tensor, int]:
    """``shadow_product`` on torch ops: the hit columns compacted, their rows gathered from the two
    tables, and a (sparse when that pays) product of the two."""
    channels, residue = outlier_extract(x, threshold)          # [k], [M, k]: the hit columns only
    if channels.numel() == 0:
        return x.new_zeros((x.shape[0], hot.shape[1])), channels, 0
    return outlier_product(residue, gather_rows(hot, cold, slot[channels])), channels, int(torch.count_nonzero(residue))


def gather_rows(hot: Tensor, cold: Tensor, slots: Tensor) -> Tensor:
    """The rows ``slots`` name (``shadow_product``'s convention) as one [k, N] float tensor; only the
    cold rows named are read."""
    is_hot = slots >= 0
    if bool(is_hot.all()):
        return hot[slots]
    out = hot.new_empty((slots.numel(), hot.shape[1]))
    out[is_hot] = hot[slots[is_hot]]
    out[~is_hot] = cold[-1 - slots[~is_hot]]
    return out


# Below this share of nonzeros a residue block is multiplied as a sparse matrix: ~5x faster than the
# dense GEMM there. Programs use the same line to choose which channels their static product keeps.
SPARSE_BELOW = 1 / 20


def outlier_product(residue: Tensor, w_rows: Tensor, out: Tensor | None = None) -> Tensor:
    """``residue [M, k] @ w_rows [k, N]`` (added into ``out`` if given), sparse when that is faster.

    Outliers cluster in a few channels (a dense residue block: one small GEMM), but when they are
    scattered over many channels the block is mostly zeros and a sparse (CSR) product is ~5x faster.
    """
    sparse = residue.numel() and int(torch.count_nonzero(residue)) < SPARSE_BELOW * residue.numel()
    with warnings.catch_warnings():  # "sparse CSR support is in beta": a notice, not a problem
        warnings.simplefilter("ignore", UserWarning)
        if sparse:
            residue = residue.to_sparse_csr()
        return torch.mm(residue, w_rows) if out is None else torch.addmm(out, residue, w_rows)


def quantize_weight(w: Tensor, granularity: str) -> tuple[Tensor, Tensor]:
    """Symmetric INT8 weight [N, K] -> (int8 [N, K], scale [N]); per output channel or per tensor."""
    w = w.detach().float()
    if granularity == "channel":
        amax = w.abs().amax(dim=1)
    else:
        amax = w.abs().max().expand(w.shape[0])
    scale = (amax / QMAX).clamp_min(1e-12)
    # w * (1 / scale), not w / scale: torch's quantize_per_channel, which folds the programs' weights
    # (pt2e), rounds that product; the two differ at a few near-ties per 100,000 weights
    q = torch.mul(w, (1.0 / scale)[:, None]).round_().clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale.contiguous()


def outlier_product_in_order(residue: Tensor, w_rows: Tensor) -> Tensor:
    """``residue [M, k] @ w_rows [k, N]`` summed as the native runner sums it (``runner/src/cold_rows.cpp``):
    per output row, the nonzero residues' products, each rounded, added in channel order to a zero
    row, without FMA. The two ``.pte`` runners then agree bit for bit: a GEMM's order would leave
    one-step differences in the prompt's K/V that a later decode step's dynamic INT8 rounding can
    turn into a different token. Work: one ``index_add_`` per outlier rank within a row (the r-th
    outlier of every row at once; outliers are few per row), not one per channel."""
    out = residue.new_zeros((residue.shape[0], w_rows.shape[1]))
    nz = residue.nonzero()                                   # row-major: by row, then by channel
    if nz.numel() == 0:
        return out
    row, ch = nz[:, 0], nz[:, 1]
    counts = torch.bincount(row, minlength=residue.shape[0])
    rank = torch.arange(row.numel()) - (counts.cumsum(0) - counts)[row]
    order = torch.argsort(rank, stable=True)
    row, ch = row[order], ch[order]
    value = residue[row, ch]
    per_rank = torch.bincount(rank).tolist()
    at = 0
    for n in per_rank:                                       # rows within one rank are distinct
        out.index_add_(0, row[at:at + n], w_rows.index_select(0, ch[at:at + n]).mul_(value[at:at + n, None]))
        at += n
    return out


@torch.library.custom_op("llmnpu::outlier_compensate", mutates_args=())
def outlier_compensate(y: Tensor, residue: Tensor, w_rows: Tensor) -> Tensor:
    """y [M, N] + residue [M, k] @ w_rows [k, N]: the float shadow matmul merged into the NPU result."""
    return outlier_product(residue, w_rows, y)


@outlier_compensate.register_fake
def _(y, residue, w_rows):
    return torch.empty_like(y)


# --------------------------------------------------------------------------- decode: dynamic INT8 linear
def prepack_dynamic(w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None):
    """An INT8 weight [N, K] with per-output-channel scales, packed once for ``dynamic_linear``: the
    native ``Int8Gemv`` on its path for this CPU (``int8_path.decode_path``), or, without the native
    kernels, fbgemm's packed weight (u8 x s8 with int32 accumulation)."""
    if native_available():
        return torch.classes.llmnpu_native.Int8Gemv(w_q.contiguous(), w_scale.float().contiguous(),
                                                    None if bias is None else bias.float().contiguous(),
                                                    int8_path.decode_path(int8_path.detect()))
    with warnings.catch_warnings():   # qint8 tensor creation is deprecated; the packed weight is what we keep
        warnings.simplefilter("ignore", UserWarning)
        qw = torch._make_per_channel_quantized_tensor(w_q, w_scale.double(), torch.zeros_like(w_scale, dtype=torch.int64), 0)
        return torch.ops.quantized.linear_prepack(qw, None if bias is None else bias.float())


def dynamic_linear(x: Tensor, packed) -> Tensor:
    """float [M, K] -> dynamic INT8 (the call's own range over all of x, asymmetric u8) x packed INT8
    weight -> int32 -> float [M, N]: one fused call, no float weight read. Decode calls it with M = 1,
    so the activation scale is the token's own. The fbgemm fallback gets 7-bit activations where its
    u8 x s8 pairs would saturate int16 (``int8_path.decode_reduce_range``)."""
    if _is_gemv(packed):
        return torch.ops.llmnpu_native.int8_gemv(packed, x)
    return torch.ops.quantized.linear_dynamic(x, packed, int8_path.decode_reduce_range())


def _is_gemv(packed) -> bool:
    return isinstance(packed, torch.ScriptObject) and packed._type().name() == "Int8Gemv"


def dynamic_linear_reference(x: Tensor, w_q: Tensor, w_scale: Tensor, bias: Tensor | None = None,
                             reduce_range: bool | None = None) -> Tensor:
    """What ``dynamic_linear`` computes, in plain integer arithmetic (for parity tests): x quantized to
    u8 over [min(x, 0), max(x, 0)] with a zero point (255 steps, or 127 with ``reduce_range``; default:
    as ``dynamic_linear`` does here), exact int64 products, dequantized in float64. The native
    ``Int8Gemv`` computes exactly this, to the bit; fbgemm picks its zero point its own way."""
    if reduce_range is None:
        reduce_range = int8_path.decode_reduce_range()
    qmax = 127 if reduce_range else 255
    lo, hi = min(float(x.min()), 0.0), max(float(x.max()), 0.0)
    scale = (hi - lo) / qmax or 1.0
    zero = int(min(max(round(-lo / scale), 0), qmax))
    x_q = torch.clamp(torch.round(x.double() / scale) + zero, 0, qmax).to(torch.int64)
    acc = (x_q - zero) @ w_q.to(torch.int64).t()
    out = acc.to(torch.float64) * (scale * w_scale.double())
    return (out if bias is None else out + bias.double()).float()
