"""torch.compile(backend="llmnpu"): parity with eager, graph breaks, fallbacks."""
import copy
import warnings

import pytest
import torch
from conftest import on_int64, outlier_model

import llmnpu_delegate.compile as C
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate, quantize_


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def partitioned(monkeypatch):
    made = []
    init = C._PartitionedGraph.__init__

    def spy(self, *a):
        init(self, *a)
        made.append(self)

    monkeypatch.setattr(C._PartitionedGraph, "__init__", spy)
    return made


def _calibrated(spec):
    lm = outlier_model(spec)
    calib = calibrate(lm.model, torch.randint(0, 1000, (2048,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=128, probe_tokens=128), progress=False)
    return lm, calib


def test_backend_is_found_by_name_through_the_entry_point():
    from torch._dynamo.backends.registry import list_backends, lookup_backend

    assert "llmnpu" in list_backends()
    assert lookup_backend("llmnpu") is C.llmnpu_backend


@pytest.mark.parametrize("spec", ["random:tiny-llama", "random:tiny-gemma2", "random:tiny-phi3"])
def test_w8a8_shadow_equals_the_quantized_eager_model(spec, partitioned):
    lm, calib = _calibrated(spec)
    # a fixed rate: on random-token text the automatic one may prune every shadow path, and this
    # test is about compiling them
    options = C.compile_options(lm, calibration=calib, pruning_rate=0.5, progress=False)
    compiled = torch.compile(lm.model, backend="llmnpu", options=options)
    reference = copy.deepcopy(lm.model)
    quantize_(reference, calib, QuantConfig(pruning_rate=0.5), lm.fingerprint, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # no eager fallback allowed here
        for length in (20, 33, 70):                   # 33 and 70: a recompilation with dynamic shapes
            ids = torch.randint(0, 1000, (1, length))
            with torch.no_grad():
                want, got, flt = reference(ids).logits, compiled(ids).logits, lm.model(ids).logits
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
            assert (got - flt).abs().max() > 1e-3     # it really is quantized
    assert partitioned and all(p.partition.by_kind("npu") for p in partitioned)
    assert any(p.partition.by_kind("shadow") for p in partitioned)
    counters = options["counters"]
    assert counters.npu_graphs == len(partitioned) and counters.npu_calls >= 3 and counters.eager_calls == 0
    assert all(isinstance(s.fn, torch.nn.Module) and type(s.fn).__name__ == "NpuRegion"
               for p in partitioned for s in p.steps if s.sub.kind == "npu")


def test_compiled_int8_equals_int64_arithmetic():
    """The compiled model's INT8 linears (whichever kernel this CPU runs) against the quantized eager
    model computing every one of them in int64: a reference that shares no kernel with them."""
    lm, calib = _calibrated("random:tiny-llama")
    options = C.compile_options(lm, calibration=calib, pruning_rate=0.5, progress=False)
    compiled = torch.compile(lm.model, backend="llmnpu", options=options)
    reference = copy.deepcopy(lm.model)
    quantize_(reference, calib, QuantConfig(pruning_rate=0.5), lm.fingerprint, progress=False)
    ids = torch.randint(0, 1000, (1, 40))
    with torch.no_grad():
        got, flt = compiled(ids).logits, lm.model(ids).logits
        want = on_int64(reference, ids).logits
    effect = float((want - flt).abs().max())
    assert effect > 1e-3 and float((got - want).abs().max()) <= effect / 1000


def test_fp32_equals_eager_and_graph_breaks_are_fine(partitioned):
    lm = load_model("random:tiny-qwen2")
    model = lm.model

    def two_calls(ids):
        a = model(ids).logits
        torch._dynamo.graph_break()
        return a, model(ids[:, :7]).logits

    compiled = torch.compile(two_calls, backend="llmnpu", options=C.compile_options(lm, quant="fp32"))
    ids = torch.randint(0, 1000, (1, 24))
    with torch.no_grad():
        got, want = compiled(ids), (model(ids).logits, model(ids[:, :7]).logits)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)
    assert len(partitioned) == 2                      # one partitioned graph on each side of the break


def test_unsupported_graph_falls_back_to_eager_with_a_warning(monkeypatch):
    lm = load_model("random:tiny-llama")

    def broken(*a, **k):
        raise RuntimeError("cannot cut this graph")

    monkeypatch.setattr(C, "partition_graph", broken)
    compiled = torch.compile(lm.model, backend="llmnpu", options=C.compile_options(lm, quant="fp32"))
    ids = torch.randint(0, 1000, (1, 12))
    with pytest.warns(UserWarning, match="not supported.*cannot cut this graph"):
        with torch.no_grad():
            got = compiled(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(got, lm.model(ids).logits)


def _failing_lower(monkeypatch):
    def broken(self, args):
        raise RuntimeError("lowering exploded")

    monkeypatch.setattr(C._PartitionedGraph, "_lower", broken)


def test_failure_at_run_time_is_an_error_by_default(monkeypatch):
    """No silent downgrade: a partitioned graph that fails does not quietly run unquantized."""
    lm = load_model("random:tiny-llama")
    options = C.compile_options(lm, quant="fp32")
    compiled = torch.compile(lm.model, backend="llmnpu", options=options)
    _failing_lower(monkeypatch)
    with pytest.raises(LlmNpuError, match="lowering exploded.*fallback='eager'"):
        with torch.no_grad():
            compiled(torch.randint(0, 1000, (1, 12)))
    assert options["counters"].npu_calls == 0 and options["counters"].eager_calls == 0


def test_eager_fallback_warns_once_and_is_counted(monkeypatch):
    lm = load_model("random:tiny-llama")
    options = C.compile_options(lm, quant="fp32", fallback="eager")
    compiled = torch.compile(lm.model, backend="llmnpu", options=options)
    _failing_lower(monkeypatch)
    ids = torch.randint(0, 1000, (1, 12))
    with pytest.warns(UserWarning, match="lowering exploded"):
        with torch.no_grad():
            got = compiled(ids).logits
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)   # warned once; eager from then on
        with torch.no_grad():
            again = compiled(ids).logits
    with torch.no_grad():
        torch.testing.assert_close(got, lm.model(ids).logits)
        torch.testing.assert_close(again, got)
    counters = options["counters"].to_dict()
    assert counters["npu_calls"] == 0 and counters["eager_calls"] == 2 and counters["eager_graphs"] >= 1
    with pytest.raises(LlmNpuError, match="unknown llmnpu fallback 'float'"):
        C.compile_options(lm, quant="fp32", fallback="float")


def test_missing_or_unknown_options_are_clear_errors():
    lm = load_model("random:tiny-llama")
    ids = torch.randint(0, 1000, (1, 8))
    with pytest.raises(Exception, match="compile_options"):
        torch.compile(lm.model, backend="llmnpu")(ids)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="unknown llmnpu compile options"):
        torch.compile(lm.model, backend="llmnpu", options={"bogus": 1})(ids)
    with pytest.raises(LlmNpuError, match="shadow"):
        C.compile_options(lm, quant="w8a8", pruning_rate=0.3)
    torch._dynamo.reset()
    options = {**C.compile_options(lm, quant="fp32"), "placement": "wings"}
    with pytest.raises(Exception, match="unknown placement 'wings'"):
        torch.compile(lm.model, backend="llmnpu", options=options)(ids)


def test_parameter_names_from_dynamo_placeholders():
    assert (C._param_fqn("L_self_modules_model_modules_layers_modules_0_modules_self_attn_modules_q_proj_"
                         "parameters_weight_") == "model.layers.0.self_attn.q_proj.weight")
    assert C._param_fqn("L_args_0_") is None
