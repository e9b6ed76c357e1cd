"""Exact INT8 on every CPU (kernels/int8_path.py): the chooser never picks a saturating kernel, every
path this machine can run sums codes exactly (compared as integers with an int64 matmul), the caps
that make oneDNN and fbgemm saturate are real, and a model of that saturation is caught."""
import os
import subprocess
import sys
import textwrap
import time

import pytest
import torch
from conftest import missing, vpmaddubsw_model

from llmnpu_delegate import kernels as K
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.kernels import int8_path, ops
from llmnpu_delegate.kernels.int8_path import Cpu, choose, decode_path, exact_on, fbgemm_exact, isa_class
from llmnpu_delegate.kernels.native_ops import missing_build_features, native_available
from llmnpu_delegate.quantize.linear import quantize_weight

X86 = "x86_64"
BASE = {"sse4_2", "avx", "avx2", "fma", "f16c"}
AVX512 = BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq"}
CPUS = {   # name: (cpu, the path expected with native kernels, without them)
    "zen3 (AVX2 only)": (Cpu(X86, frozenset(BASE)), "avx2", "int64"),
    "skylake-x (AVX-512, no VNNI)": (Cpu(X86, frozenset(AVX512)), "avx512", "int64"),
    "zen4 (AVX-512 VNNI)": (Cpu(X86, frozenset(AVX512 | {"avx512_vnni", "avx512_bf16"})), "onednn", "onednn"),
    "zen4, oneDNN capped at AVX2": (Cpu(X86, frozenset(AVX512 | {"avx512_vnni"}), onednn_cap="AVX2"), "avx512", "int64"),
    "zen4, oneDNN capped at AVX512_CORE": (Cpu(X86, frozenset(AVX512 | {"avx512_vnni"}), onednn_cap="AVX512_CORE"),
                                           "avx512", "int64"),
    "alder lake (AVX-VNNI, no AVX-512)": (Cpu(X86, frozenset(BASE | {"avx_vnni"})), "onednn", "onednn"),
    "alder lake, oneDNN capped at AVX2": (Cpu(X86, frozenset(BASE | {"avx_vnni"}), onednn_cap="AVX2"), "avx2", "int64"),
    "sapphire rapids (AMX)": (Cpu(X86, frozenset(AVX512 | {"avx512_vnni", "amx_int8", "amx_tile"})), "onednn", "onednn"),
    "aarch64 (dotprod)": (Cpu("aarch64", frozenset({"asimd", "asimddp"})), "portable", "int64"),
    "old x86 (SSE only)": (Cpu(X86, frozenset({"sse4_2"})), "portable", "int64"),
}


def _saturates(cpu: Cpu, path: str) -> bool:
    """Independent statement of the hazard: oneDNN's u8 x s8 kernels (and torch._int_mm, which runs on
    oneDNN) saturate int16 unless an int32-accumulating instruction is both present and allowed."""
    if path not in ("onednn", "int_mm"):
        return False
    vnni512 = "avx512_vnni" in cpu.flags and cpu.onednn_cap in ("", "AVX512_CORE_VNNI", "AVX512_CORE_BF16")
    vnni256 = "avx_vnni" in cpu.flags and cpu.onednn_cap in ("", "AVX2_VNNI")
    return cpu.arch != X86 or not (vnni512 or vnni256)


@pytest.mark.parametrize("name", list(CPUS))
def test_chooser_never_picks_a_saturating_path(name):
    cpu, with_native, without = CPUS[name]
    for native, want in ((True, with_native), (False, without)):
        path = choose(cpu, native)
        assert path == want, f"{name}: chose {path}, expected {want}"
        assert not _saturates(cpu, path) and exact_on(path, cpu)


def test_isa_classes_and_decode_exactness_of_the_table():
    assert isa_class(CPUS["zen3 (AVX2 only)"][0]) == "avx2"
    assert isa_class(CPUS["sapphire rapids (AMX)"][0]) == "amx"
    assert isa_class(CPUS["aarch64 (dotprod)"][0]) == "aarch64-dotprod"
    # fbgemm has no AVX-VNNI kernels: only AVX-512 VNNI keeps its 8-bit dynamic linear exact
    assert fbgemm_exact(CPUS["zen4 (AVX-512 VNNI)"][0])
    assert not fbgemm_exact(CPUS["alder lake (AVX-VNNI, no AVX-512)"][0])
    assert not fbgemm_exact(CPUS["zen3 (AVX2 only)"][0])
    assert not fbgemm_exact(Cpu(X86, frozenset(AVX512 | {"avx512_vnni"}), fbgemm_cap="AVX2"))
    # the native decode GEMV: vpdpbusd only with AVX-512 VNNI (and VL), the sign trick on other AVX2 CPUs
    want = {"zen3 (AVX2 only)": "avx2", "skylake-x (AVX-512, no VNNI)": "avx2", "zen4 (AVX-512 VNNI)": "vnni",
            "alder lake (AVX-VNNI, no AVX-512)": "avx2", "sapphire rapids (AMX)": "vnni",
            "aarch64 (dotprod)": "portable", "old x86 (SSE only)": "portable"}
    assert {name: decode_path(CPUS[name][0]) for name in want} == want


def _runnable_paths():
    """Every INT8 path, those this machine cannot run as named skips (a list that shrank with the CPU
    would hide what was not tested)."""
    cpu = int8_path.detect()

    def why_not(p):
        if not exact_on(p, cpu):
            return f"{p} is not exact (or not available) on this CPU ({int8_path.isa_class(cpu)})"
        if p in int8_path.NATIVE_PATHS and not native_available():
            return missing("the native kernels (make kernels)")
        if p == "onednn" and not int8_path._onednn_available():
            return "this torch build has no oneDNN"
        return None
    return [pytest.param(p, marks=pytest.mark.skip(reason=why_not(p))) if why_not(p) else p for p in int8_path.PATHS]


def _accumulate(path, x_q, w_q):
    """The path's output with unit scales (float32 holds the int32 sum when it is < 2^24)."""
    n = w_q.shape[0]
    x = (x_q.short() + 128).to(torch.uint8) if ops._wants_u8(path) else x_q
    return ops._gemm(path, x, 1.0, ops._pack(w_q, path), n, torch.ones(n), None)


def _extremes(m, k, n):
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x_q[0], w_q[0] = 127, 127            # the largest positive pairs: what saturates int16 first
    x_q[-1], w_q[-1] = -127, 127         # and the largest negative ones
    return x_q, w_q


@pytest.mark.parametrize("path", _runnable_paths())
@pytest.mark.parametrize("m,k,n", [(1, 8, 4), (7, 33, 19), (13, 577, 45), (100, 1040, 70), (3, 16384, 33)])
def test_every_path_sums_codes_exactly(path, m, k, n):
    x_q, w_q = _extremes(m, k, n)
    exact = x_q.long() @ w_q.long().t()
    got = _accumulate(path, x_q, w_q)
    # below 2^24 float32 is the integer itself; above, both are the one rounding of the exact sum
    if path == "onednn" and not torch.equal(got, exact.float()):
        # oneDNN's AMX kernel sums u8 x s8 exactly in int32 but subtracts the zero point's share
        # (128 * sum W) in float32: one more rounding where sum (x + 128) W passes 2^24 (seen on
        # Sapphire Rapids; VNNI kernels return the integer). Exactly that, and nothing else, is allowed.
        shifted = ((x_q.long() + 128) @ w_q.long().t()).float() - (128 * w_q.long().sum(1)).float()
        assert torch.equal(got, shifted), f"onednn: off by up to {(got.double() - exact.double()).abs().max()}"
        assert ((x_q.long() + 128) @ w_q.long().t()).abs().max() >= 2 ** 24
        return
    assert torch.equal(got, exact.float()), f"{path}: off by up to {(got.double() - exact.double()).abs().max()}"
    if path in int8_path.NATIVE_PATHS:            # and as int32, where the native kernel can return it
        acc = torch.ops.llmnpu_native.int8_gemm(x_q, 1.0, ops._pack(w_q, path), n, None, None, path)
        assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact)


@pytest.mark.parametrize("path", _runnable_paths())
def test_every_path_has_the_reference_epilogue(path):
    """Scales and bias after the int32 sum: the native paths and int_mm round exactly as the int64
    reference does; oneDNN's fused epilogue may round its two multiplications in another order."""
    x_q, w_q = _extremes(64, 96, 40)
    w_scale, bias = torch.rand(40) * 0.01 + 1e-4, torch.randn(40)
    with int8_path.forced(path):
        got = K.int8_linear(x_q, 0.02, w_q, w_scale, bias)
    want = ops.int8_linear_reference(x_q, 0.02, w_q, w_scale, bias)
    if path == "onednn":
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("path", _runnable_paths())
def test_a_packed_form_goes_with_its_weight(path):
    """Packing is cached per weight, held by a weak reference: once the weight is gone, so is its
    packed form (the int_mm and int64 paths' forms were the weight itself and kept it for good)."""
    import gc

    w_q = torch.randint(-127, 128, (24, 40), dtype=torch.int8)
    x_q = torch.randint(-127, 128, (3, 40), dtype=torch.int8)
    assert torch.equal(_accumulate(path, x_q, w_q), (x_q.long() @ w_q.long().t()).float())
    gone = __import__("weakref").ref(w_q)
    del w_q
    gc.collect()
    assert gone() is None
    assert all(ref() is not None for ref, _ in ops._packed_cache.values())


def test_the_saturation_model_reproduces_the_measurement_and_is_caught():
    """The model gives the number measured on Zen 3 (73,440 for all-127 codes over K = 576), and the
    exactness check above would fail on it by far more than any rounding."""
    ones = torch.full((1, 576), 127, dtype=torch.int8)
    assert int(vpmaddubsw_model(ones, ones)) == 73440
    x_q, w_q = _extremes(16, 576, 24)
    assert (vpmaddubsw_model(x_q, w_q) - x_q.long() @ w_q.long().t()).abs().max() > 1000


def _run(code: str, **env) -> subprocess.CompletedProcess:
    full = {**os.environ, **env}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=full, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.skipif(not int8_path.detect().has("avx2"), reason="needs an x86 CPU with AVX2")
def test_onednn_capped_at_avx2_saturates_and_is_never_chosen():
    """ONEDNN_MAX_CPU_ISA=AVX2 makes any x86 machine compute as an AVX2-only one does: oneDNN then
    returns the saturated sum (seen here), the chooser moves to an exact path, and forcing oneDNN is
    refused with one line."""
    probe = _run("""
        import torch
        from llmnpu_delegate import kernels as K
        from llmnpu_delegate.kernels import int8_path, ops
        ones = torch.full((1, 576), 127, dtype=torch.int8)
        raw = ops._gemm("onednn", (ones.short() + 128).to(torch.uint8), 1.0, ops._pack(ones, "onednn"), 1,
                        torch.ones(1), None)
        print(int(raw), int8_path.current(), int(K.int8_linear(ones, 1.0, ones, torch.ones(1))))
    """, ONEDNN_MAX_CPU_ISA="AVX2", LLMNPU_INT8_KERNEL="auto")
    assert probe.returncode == 0, probe.stderr
    raw, path, exact = probe.stdout.split()
    assert int(raw) == 73440 and path != "onednn" and int(exact) == 127 * 127 * 576
    refused = _run("from llmnpu_delegate.kernels import int8_path; int8_path.current()",
                   ONEDNN_MAX_CPU_ISA="AVX2", LLMNPU_INT8_KERNEL="onednn")
    assert refused.returncode != 0 and "would saturate" in refused.stderr


@pytest.mark.skipif(not int8_path.detect().has("avx2"), reason="needs an x86 CPU with AVX2")
def test_fbgemm_capped_at_avx2_saturates_unless_range_is_reduced():
    """Decode's fbgemm fallback (no native kernels) on an AVX2-only CPU: 8-bit activations saturate
    (far from the integer reference), 7-bit ones (what the fallback then uses) equal it."""
    probe = _run("""
        import torch
        from llmnpu_delegate import kernels as K
        from llmnpu_delegate.kernels import int8_path
        from llmnpu_delegate.quantize.linear import quantize_weight
        g = torch.Generator().manual_seed(0)
        w, x = torch.randn(256, 576, generator=g), torch.randn(1, 576, generator=g) * 3
        w_q, w_scale = quantize_weight(w, "channel")
        packed = K.prepack_dynamic(w_q, w_scale)
        full = torch.ops.quantized.linear_dynamic(x, packed, False)
        err8 = (full - K.dynamic_linear_reference(x, w_q, w_scale, reduce_range=False)).abs().max()
        err7 = (K.dynamic_linear(x, packed) - K.dynamic_linear_reference(x, w_q, w_scale)).abs().max()
        quant = (K.dynamic_linear_reference(x, w_q, w_scale) - x @ w.t()).abs().max()
        print(int8_path.decode_reduce_range(), float(err8), float(err7), float(quant))
    """, FBGEMM_ENABLE_INSTRUCTIONS="AVX2", LLMNPU_KERNELS="off")
    assert probe.returncode == 0, probe.stderr
    reduced, err8, err7, quant = probe.stdout.split()
    assert reduced == "True"
    assert float(err8) > float(quant) / 10           # the saturation is an error of the quantization's size
    assert float(err7) < float(quant) / 100          # the 7-bit path is integer arithmetic


def _decode_paths():
    """Every decode path, those this machine cannot run as named skips."""
    def why_not(p):
        if not native_available():
            return missing("the native kernels (make kernels)")
        return None if torch.ops.llmnpu_native.int8_gemv_supported(p) else f"this CPU cannot run the {p} decode kernel"
    return [pytest.param(p, marks=pytest.mark.skip(reason=why_not(p))) if why_not(p) else p
            for p in int8_path.DECODE_PATHS]


def _u8_extremes(m, k, n):
    x = torch.randint(0, 256, (m, k), dtype=torch.uint8)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x[0], w_q[0] = 255, 127              # u8 x s8 pairs at their largest: 2 * 255 * 127 > 32767
    x[-1], w_q[-1] = 255, -127
    if m > 2:
        x[1] = 0                         # and the code that becomes -128 on the avx2 path
    return x, w_q


@pytest.mark.parametrize("path", _decode_paths())
@pytest.mark.parametrize("m,k,n", [(1, 4, 8), (1, 33, 19), (3, 577, 45), (1, 4864, 903), (2, 16384, 33)])
def test_every_decode_path_sums_codes_exactly(path, m, k, n):
    """The native decode GEMV (Int8Gemv) on each path this CPU runs: the u8 x s8 sums as int32 equal an
    int64 matmul, including the all-255 x 127 rows a vpmaddubsw kernel saturates on."""
    x, w_q = _u8_extremes(m, k, n)
    gemv = torch.classes.llmnpu_native.Int8Gemv(w_q, torch.ones(n), None, path)
    exact = x.long() @ w_q.long().t()
    acc = gemv.accumulate(x)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), exact), f"{path}: off by {(acc - exact).abs().max()}"
    # what a kernel that sums two u8 x s8 products into a saturating int16 would give: far off here
    pairs = (x.long().view(m, 1, -1, 2) * w_q.long().view(1, n, -1, 2)).sum(-1) if k % 2 == 0 else None
    if pairs is not None:
        assert (pairs.clamp(-32768, 32767).sum(-1) - exact).abs().max() > 1000


@pytest.mark.parametrize("path", _decode_paths())
def test_every_decode_path_is_the_reference_to_the_bit(path):
    """Quantizing x with its own range, the zero point and the float64 epilogue: the float output equals
    ``dynamic_linear_reference`` bit for bit on every path (and is far closer to it than to float)."""
    g = torch.Generator().manual_seed(1)
    w, b = torch.randn(300, 1536, generator=g), torch.randn(300, generator=g)
    x = torch.randn(2, 1536, generator=g) * 3
    x[0, 9] = -50.0                                      # an outlier sets the range
    w_q, w_scale = quantize_weight(w, "channel")
    got = torch.classes.llmnpu_native.Int8Gemv(w_q, w_scale, b, path).forward(x)
    assert torch.equal(got, K.dynamic_linear_reference(x, w_q, w_scale, b, reduce_range=False))
    assert (got - torch.nn.functional.linear(x, w, b)).abs().max() > 1e-3


@pytest.mark.skipif(not native_available(), reason=missing("the native kernels (make kernels)"))
def test_decode_gemv_refuses_bad_input():
    with pytest.raises(RuntimeError, match="unknown path 'sse'"):
        torch.classes.llmnpu_native.Int8Gemv(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), None, "sse")
    with pytest.raises(RuntimeError, match="symmetric"):
        torch.classes.llmnpu_native.Int8Gemv(torch.full((4, 8), -128, dtype=torch.int8), torch.ones(4), None,
                                             "portable")
    gemv = torch.classes.llmnpu_native.Int8Gemv(torch.zeros(4, 8, dtype=torch.int8), torch.ones(4), None, "portable")
    with pytest.raises(RuntimeError, match=r"x must be float32 \[M, 8\]"):
        gemv.forward(torch.zeros(1, 9))


def test_forcing_an_unknown_or_impossible_path_is_one_clear_error():
    bad = _run("from llmnpu_delegate.kernels import int8_path; int8_path.current()", LLMNPU_INT8_KERNEL="vnni9")
    assert bad.returncode != 0 and "LLMNPU_INT8_KERNEL=vnni9 is not an INT8 kernel" in bad.stderr
    with pytest.raises(LlmNpuError, match="unknown INT8 kernel path"):
        with int8_path.forced("fast"):
            pass


def test_a_build_for_another_cpu_is_refused(tmp_path):
    """The native kernels are built with -march=native: a build folder carried to a CPU without one
    of its features must be refused before it is loaded."""
    (tmp_path / "libllmnpu_kernels.so").write_bytes(b"")
    (tmp_path / "build-isa.txt").write_text("AVX2 FMA AVX512_NOSUCHFEATURE\n")
    lib = tmp_path / "libllmnpu_kernels.so"
    assert missing_build_features(lib) == ["avx512_nosuchfeature"]
    refused = _run("from llmnpu_delegate.kernels.native_ops import native_available; native_available()",
                   LLMNPU_KERNELS=str(lib))
    assert refused.returncode != 0 and "rebuild them here with `make kernels`" in refused.stderr
    (tmp_path / "build-isa.txt").write_text("\n")
    assert missing_build_features(lib) == []


@pytest.mark.skipif(not native_available(), reason=missing("the native kernels (make kernels)"))
def test_this_build_runs_here():
    from llmnpu_delegate.kernels.native_ops import _library_path
    assert missing_build_features(_library_path()) == []


def test_the_avx2_emulation_hides_everything_above_avx2():
    """LLMNPU_CPU_ISA=avx2 (what `make test-avx2` sets): the project sees an AVX2-only CPU, so the
    chooser leaves oneDNN and a native build made for AVX-512 is refused."""
    probe = _run("""
        from llmnpu_delegate.kernels import int8_path
        cpu = int8_path.detect()
        print(int8_path.isa_class(cpu), int8_path.current(), any(f.startswith("avx512") for f in cpu.flags))
    """, LLMNPU_CPU_ISA="avx2", LLMNPU_INT8_KERNEL="auto", LLMNPU_KERNELS="off")
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.split() == ["avx2", "int64", "False"] or not int8_path.detect().has("avx2")
    bad = _run("from llmnpu_delegate.kernels import int8_path; int8_path.detect()", LLMNPU_CPU_ISA="sse9")
    assert bad.returncode != 0 and "LLMNPU_CPU_ISA=sse9" in bad.stderr


def test_info_reports_the_kernel_the_emulated_cpu_gets():
    """`llmnpu info --json` as an AVX2-only CPU without native kernels: its class, an exact kernel that
    is not oneDNN, and decode's fbgemm fallback with 7-bit activations."""
    import json
    probe = _run("from llmnpu_delegate.cli import main; main(['info', '--json'])",
                 LLMNPU_CPU_ISA="avx2", LLMNPU_INT8_KERNEL="auto", LLMNPU_KERNELS="off")
    assert probe.returncode == 0, probe.stderr
    r = json.loads(probe.stdout)
    assert r["isa"] == "avx2" and r["int8_kernel"] == "int64"
    assert r["decode_kernel"] == "fbgemm-7bit" and r["decode_activation_bits"] == 7
    assert r["onednn_exact_here"] is False and r["native_kernels"] is None


@pytest.mark.skipif(not native_available(), reason=missing("the native kernels (make kernels)"))
@pytest.mark.parametrize("path", [p for p in int8_path.NATIVE_PATHS if p in _runnable_paths()])
def test_a_waiting_helper_shares_the_gemm_and_changes_no_bit(path):
    """The prefill's idle CPU worker runs pieces of the NPU lane's GEMM while it waits
    (``spin_wait(..., help=1)``): the pieces must really run on the helper, and every output must be
    the exact sum (int32) and the reference epilogue (float) as without it."""
    import ctypes
    import threading

    from llmnpu_delegate.kernels import native_ops

    spin = native_ops.spin_wait()
    x_q, w_q = _extremes(200, 1040, 300)
    n, packed = w_q.shape[0], ops._pack(w_q, path)
    w_scale, bias = torch.rand(n) * 0.01 + 1e-4, torch.randn(n)
    exact = x_q.long() @ w_q.long().t()
    word, ready = ctypes.c_int64(0), threading.Event()

    def helper():
        ready.set()
        spin(ctypes.byref(word), 0, int(30e9), 1)     # until the word changes

    saved = torch.get_num_threads()
    torch.set_num_threads(1)                # the executor's workers: one thread each
    thread = threading.Thread(target=helper)
    before = native_ops.pieces_helped()
    thread.start()
    try:
        ready.wait()
        # the helper may need a moment to start spinning, long on a loaded machine: GEMMs until it has
        # taken a piece (a liveness bound of a minute, not a speed check)
        deadline = time.monotonic() + 60
        while native_ops.pieces_helped() == before and time.monotonic() < deadline:
            acc = torch.ops.llmnpu_native.int8_gemm(x_q, 1.0, packed, n, None, None, path)
            assert torch.equal(acc.long(), exact)
        for _ in range(3):
            acc = torch.ops.llmnpu_native.int8_gemm(x_q, 1.0, packed, n, None, None, path)
            assert torch.equal(acc.long(), exact)
            with int8_path.forced(path):
                got = K.int8_linear(x_q, 0.02, w_q, w_scale, bias)
            assert torch.equal(got, ops.int8_linear_reference(x_q, 0.02, w_q, w_scale, bias))
    finally:
        word.value = 1
        thread.join()
        torch.set_num_threads(saved)
    assert native_ops.pieces_helped() > before
