import logging
import os
import shutil
import subprocess
import sys
import tempfile

import pytest
import torch

# The default text is read from the user's text folder (prepared there on first use, as an
# installed package does); caches of a test session live in a temporary folder, so tests never
# read a stale user cache.
if "LLMNPU_DATA_DIR" not in os.environ:
    from llmnpu_delegate.text import default_text_file

    os.environ["LLMNPU_DATA_DIR"] = str(default_text_file("calib").parent)
# A session's cache holds ~1.3 GB of calibrated weights; one made here is removed when the session
# ends, or repeated runs fill the disk.
_SESSION_CACHE = None
if "LLMNPU_CACHE_DIR" not in os.environ:
    _SESSION_CACHE = tempfile.mkdtemp(prefix="llmnpu-test-cache-")
    os.environ["LLMNPU_CACHE_DIR"] = _SESSION_CACHE
for _name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(_name).setLevel(logging.ERROR)


# ``make test`` installs every extra and builds the kernels and runners, and says so with
# LLMNPU_FULL_SUITE=1: there a test skipped for something missing (its reason made by ``missing``)
# fails instead. What a CPU cannot run stays a skip that names the CPU's reason.
FULL_SUITE = os.environ.get("LLMNPU_FULL_SUITE") == "1"
_MISSING = "missing install or build: "


def missing(what: str) -> str:
    """The skip reason of a test that needs ``what``, which ``make test`` installs or builds."""
    return _MISSING + what


def _fail_if_missing(report) -> None:
    if FULL_SUITE and report.skipped and _MISSING in str(report.longrepr):
        report.outcome = "failed"
        report.longrepr = (f"{report.longrepr}\n(make test installs and builds everything: under "
                           f"LLMNPU_FULL_SUITE=1 this is a failure, not a skip)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    _fail_if_missing(outcome.get_result())


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    outcome = yield
    _fail_if_missing(outcome.get_result())


def pytest_sessionfinish(session, exitstatus):
    if _SESSION_CACHE is not None:
        shutil.rmtree(_SESSION_CACHE, ignore_errors=True)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2():
    from llmnpu_delegate.models import load_model

    return load_model("smollm2-135m")


def inject_outliers(model, scale: float = 60.0, channels=(3, 17)):
    """Make a random model's linear inputs heavy-tailed, as real LLMs are: a few channels of each
    block's input norm get a large gain, so the q/k/v inputs carry outliers in those channels."""
    with torch.no_grad():
        for name, m in model.named_modules():
            w = getattr(m, "weight", None)
            if name.endswith("input_layernorm") and isinstance(w, torch.Tensor) and w.dim() == 1 and w.numel() > max(channels):
                if w.abs().mean() < 0.5:  # gemma-style norms scale by (1 + w), w starting at 0
                    w[list(channels)] += scale
                else:
                    w[list(channels)] *= scale
    return model


def outlier_model(spec: str = "random:tiny-llama"):
    """``spec`` with injected outliers (``inject_outliers``), fingerprinted after the injection: what
    is calibrated or compiled for it is filed apart from the clean model's, which a CLI run of the
    same spec loads and must not be handed."""
    from llmnpu_delegate.models import fingerprint, load_model

    lm = load_model(spec)
    inject_outliers(lm.model)
    lm.fingerprint = fingerprint(lm.model)
    return lm


def run_python(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    """``script`` in a fresh interpreter (``args`` its ``sys.argv[1:]``), which must exit 0; its
    output captured as text. For what a process's state would hide: what loads first, file descriptors."""
    done = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    return done


TINY_CHUNK = 32          # the tiny engine's chunk


def tiny_engine(quant="w8a8-shadow", placement="paper", pruning_rate=0.85, spec="random:tiny-llama"):
    """The tiny llama (or ``spec``) with injected outliers, calibrated on random ids, with a fixed plan: 85 % of the
    shadow paths pruned (``pruning_rate``), every layer's effect measured alone (the plan the .pte
    gates in test_export.py and test_qnn.py were measured on; the grouped profile ranks this random
    model's layers differently)."""
    from llmnpu_delegate.quantize import CalibConfig, calibrate, importance, quant_config
    from llmnpu_delegate.runtime.engine import Prefiller

    lm = outlier_model(spec)
    calib = calibrate(lm.model, torch.randint(0, 1000, (2048,), generator=torch.Generator().manual_seed(1)),
                      lm.fingerprint, CalibConfig(samples=4, tokens=128, probe_tokens=128), progress=False)
    quant = quant_config(quant, pruning_rate=pruning_rate) if quant == "w8a8-shadow" else quant
    saved, importance.OUTLIER_RATIO = importance.OUTLIER_RATIO, 0.0
    try:
        # fp32 attention, as the exported program's CPU methods compute it
        return Prefiller(lm, chunk_len=TINY_CHUNK, quant=quant, calibration=calib, progress=False, attention="fp32",
                         placement=placement)
    finally:
        importance.OUTLIER_RATIO = saved


def export_8bit(engine, path, target="cpu-int8", soc=None, decode="int8", fine=True):
    """``engine``'s program with 8-bit outputs, every output with a second encoding when ``fine``."""
    from llmnpu_delegate.lower import npu_subgraphs
    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.pte import export_pte

    ids = torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(2))
    with pytest.MonkeyPatch.context() as patch:
        if fine:
            patch.setattr(npu_subgraphs, "FINE_BELOW_DB", float("inf"))
        export_pte(engine, path, ids, ExportConfig(target=target, soc=soc, context=4 * TINY_CHUNK, decode=decode,
                                                   output_bits=8),
                   model={"spec": "random:tiny-llama"}, progress=False)
    return path


@pytest.fixture(scope="session")
def shared_tiny_engine():
    """One ``tiny_engine()`` for the modules that only read it (the exports of its programs)."""
    return tiny_engine()


@pytest.fixture(scope="session")
def tiny_8bit(shared_tiny_engine, tmp_path_factory):
    """``shared_tiny_engine``'s cpu-int8 program with 8-bit outputs, every one with a second encoding (``export_8bit``):
    read by the qnn mode's tests and by the native runner's merge of second encodings."""
    return export_8bit(shared_tiny_engine, tmp_path_factory.mktemp("tiny8") / "tiny8.pte")


def assert_within_quant_effect(got, quantized, float_ref, share: float = 0.1):
    """``got`` must equal the quantized reference to within ``share`` of what quantization itself
    changed (max over elements): a tolerance scaled to the effect under test, never a fixed number."""
    effect = float((quantized - float_ref).abs().max())
    error = float((got - quantized).abs().max())
    assert effect > 0, "quantization changed nothing: the comparison would prove nothing"
    assert error <= share * effect, f"|got - quantized| = {error:.3g} > {share} x quantization effect {effect:.3g}"
    return error, effect


def on_int64(fn, *args, **kwargs):
    """``fn(*args, **kwargs)`` with every INT8 linear built or run inside on the int64 path: plain
    integer arithmetic that shares no code with the kernel this CPU runs (kernels/int8_path.py).
    Build a reference engine with it, and call that engine with it too."""
    from llmnpu_delegate.kernels import int8_path

    with int8_path.forced("int64"):
        return fn(*args, **kwargs)


def vpmaddubsw_model(x_q, w_q):
    """oneDNN's and fbgemm's u8 x s8 arithmetic without VNNI, modelled: u = q + 128, each pair of
    products summed into a saturating int16, the zero point's share (128 * sum(w)) taken off in int32.
    It reproduces the 73,440 measured on Zen 3 for all-127 codes over K = 576."""
    u = x_q.long() + 128
    prods = u[:, None, :] * w_q.long()[None, :, :]                        # [M, N, K]
    if prods.shape[-1] % 2:
        prods = torch.nn.functional.pad(prods, (0, 1))
    pairs = (prods[..., 0::2] + prods[..., 1::2]).clamp(-32768, 32767)
    return pairs.sum(-1) - 128 * w_q.long().sum(1)[None, :]


@pytest.fixture
def saturating_kernel(monkeypatch):
    """Every INT8 linear but the int64 reference computes as a CPU without VNNI would (the fake a
    reference must catch)."""
    from llmnpu_delegate.kernels import ops

    real = ops._gemm

    def gemm(path, x, x_scale, packed, n, w_scale, bias):
        if path == "int64":
            return real(path, x, x_scale, packed, n, w_scale, bias)
        x_q = (x.short() - 128).to(torch.int8) if x.dtype == torch.uint8 else x
        w_q = packed if isinstance(packed, torch.Tensor) and packed.dtype == torch.int8 else next(
            ref() for ref, p in list(ops._packed_cache.values()) if p is packed)   # the weight it was packed from
        return ops._epilogue(vpmaddubsw_model(x_q, w_q), x_scale, w_scale, bias)

    monkeypatch.setattr(ops, "_gemm", gemm)
    return gemm
