"""NPU backends behind one interface: the registry, and a stub backend that only this file defines.

The stub is what a new backend costs: one class and ``register``. It lowers regions with the
cpu-int8 engine but counts every call, so the tests see that the engine, ``torch.compile``, export
and the CLI reach a backend by its name through the registry and through nothing else.
"""
from __future__ import annotations

import pytest
import torch

from llmnpu_delegate import backends
from llmnpu_delegate.backends.cpu_int8 import CpuInt8Engine
from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.cli import build_parser
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate
from llmnpu_delegate.runtime.engine import Prefiller

STUB = "stub-npu"
QUANT = QuantConfig(outliers="shadow", pruning_rate=0.5)


class Counting(CpuInt8Engine):
    lowered: list[int] = []

    def lower_npu(self, sub):
        Counting.lowered.append(sub.index)
        return super().lower_npu(sub)


class Stub:
    """A backend in a dozen lines: the cpu-int8 engine's numbers, its own name and counters."""
    name = STUB
    summary = "a test's stub"
    runs_engine = True
    encodings = "xnnpack"
    output_bits = (32, 8)
    uses_soc = False
    shares_contexts = False
    pieces: dict = {}
    missing = "a stub's regions hold linears only"
    lowered_methods: list[str] = []

    def engine(self, model, fingerprint, chunk_len, plans, weights="channel", cache=None):
        return Counting(model, fingerprint, chunk_len, plans, weights, cache)

    def check_target(self, soc):
        pass

    def quantizer(self, ours):
        return ours

    def lower(self, graphs, soc):
        Stub.lowered_methods.extend(graphs)
        return backends.get("cpu-int8").lower(graphs, soc)

    def join(self, delegates):
        pass

    def prepare_runtime(self):
        pass

    def native_env(self):
        return {}


@pytest.fixture
def stub():
    backends.register(Stub)
    Counting.lowered.clear()
    Stub.lowered_methods.clear()
    yield
    backends.registry.unregister(STUB)


@pytest.fixture(scope="module")
def tiny():
    lm = load_model("random:tiny-llama")
    ids = torch.randint(0, 1000, (4 * 32,), generator=torch.Generator().manual_seed(1))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=4, tokens=32, probe_tokens=32), progress=False)
    return lm, calib


def test_the_registry_names_the_backends_and_refuses_unknown_ones():
    assert backends.names()[0] == backends.DEFAULT == "cpu-int8" and "qnn" in backends.names()
    assert backends.names(engine=True) == ("cpu-int8",)
    for backend in map(backends.get, backends.names()):
        assert isinstance(backend, backends.NpuBackend)
    with pytest.raises(LlmNpuError, match="unknown backend 'tpu': use one of cpu-int8, qnn"):
        backends.get("tpu")
    with pytest.raises(LlmNpuError, match="'qnn' has no engine on this host.*cpu-int8.*llmnpu export --backend qnn"):
        backends.get("qnn", engine=True)
    with pytest.raises(TypeError, match="does not implement NpuBackend"):
        backends.register(type("Half", (), {"name": "half"}))


def test_a_registered_backend_runs_the_engine_and_only_it_lowers(stub, tiny, tmp_path):
    lm, calib = tiny
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(2))
    kwargs = dict(quant=QUANT, calibration=calib, progress=False, policy="inorder", attention="fp32")
    ours = Prefiller(lm, 32, backend=STUB, cache=GraphCache(tmp_path / "a"), **kwargs)
    npu = [s.sub.index for s in ours.program.steps if s.sub.kind == "npu"]
    assert sorted(Counting.lowered) == npu and npu          # every NPU subgraph went through the stub
    ref = Prefiller(lm, 32, cache=GraphCache(tmp_path / "b"), **kwargs)
    assert torch.equal(ours(ids).logits, ref(ids).logits)   # the same engine underneath: the same bits
    with pytest.raises(LlmNpuError, match="unknown backend"):
        Prefiller(lm, 32, backend="tpu", **kwargs)


def test_torch_compile_reaches_the_backend_by_name(stub, tiny):
    from llmnpu_delegate.compile import compile_options

    lm, calib = tiny
    options = compile_options(lm, QUANT, calibration=calib, progress=False, backend=STUB)
    ids = torch.randint(0, 1000, (1, 20), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.compile(lm.model, backend="llmnpu", options=options)(ids)
    assert Counting.lowered                                  # the compiled graph's regions came from the stub
    with pytest.raises(LlmNpuError, match="'qnn' has no engine"):
        compile_options(lm, QUANT, calibration=calib, progress=False, backend="qnn")


def test_the_cli_offers_every_registered_backend(stub):
    parser = build_parser()
    assert parser.parse_args(["run", "--prompt", "hi", "--backend", STUB]).backend == STUB
    assert parser.parse_args(["export", "--out", "m.pte", "--backend", STUB]).backend == STUB
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--prompt", "hi", "--backend", "qnn"])     # no engine here: export only


def test_export_lowers_npu_methods_through_the_backend(stub, tiny):
    """One NPU region through export's own path (``lower_region``) with the stub as the target."""
    from llmnpu_delegate.lower.npu_subgraphs import lower_region, region_spec
    from llmnpu_delegate.quantize.apply import LinearPlan

    lin = torch.nn.Linear(16, 8).eval()
    rows = torch.randn(32, 16)
    plans = {"lin": LinearPlan(act_scale=float(rows.abs().max()) / 127)}
    spec = region_spec("npu_0", ["lin"], plans)
    edge, encodings = lower_region(spec, [lin], plans, "channel", rows, 32, STUB)
    assert Stub.lowered_methods == ["npu_0"] and list(edge.methods) == ["npu_0"] and len(encodings) == 1
