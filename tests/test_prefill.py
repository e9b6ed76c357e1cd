"""Chunked prefill on exported, partitioned graphs against independent references: the Hugging Face
model's own full-prompt forward (float) and the unchunked quantized model (W8A8 + shadow)."""
import copy

import pytest
import torch
from conftest import assert_within_quant_effect, inject_outliers, on_int64, outlier_model
from hypothesis import HealthCheck, given, settings, strategies as st

from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.families import tiny_shapes
from llmnpu_delegate.format.tasks import build_tasks
from llmnpu_delegate.models import load_model
from llmnpu_delegate.paths import load_checked, save_checked
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate, quantize_
from llmnpu_delegate.runtime.engine import Prefiller, prefill

FAMILIES = tiny_shapes()     # one per declared family (families.py)
QUANT = QuantConfig(pruning_rate=0.5)   # half the linears keep a shadow path, half are pruned
# Chunked against unchunked: attention in fp32 on both sides, so that only chunking and quantization
# are compared (bf16 attention has its own tests: test_attention_precision.py).
FP32_ATTENTION = {"attention": "fp32"}


def _hf(model, ids):
    with torch.no_grad():
        out = model(ids[None], use_cache=True)
    return out.logits[0, -1], out.past_key_values


def _assert_kv_close(result, hf_cache, atol=1e-4):
    for k, v, layer in zip(result.past_k, result.past_v, hf_cache.layers):
        n = layer.keys.shape[2]   # sliding-window layers of HF keep only the window's tail
        torch.testing.assert_close(k[:, :, -n:], layer.keys, atol=atol, rtol=1e-4)
        torch.testing.assert_close(v[:, :, -n:], layer.values, atol=atol, rtol=1e-4)


@pytest.fixture(scope="module")
def llama():
    lm = outlier_model()
    return lm


@pytest.fixture(scope="module")
def llama_calib(llama):
    ids = torch.randint(0, 1000, (4 * 64,), generator=torch.Generator().manual_seed(1))
    return calibrate(llama.model, ids, llama.fingerprint, CalibConfig(samples=4, tokens=64, probe_tokens=64),
                     progress=False)


# Chunk 24 has a tail program of 8 rows: the property tests below check it against the same
# references whenever a prompt's last part fits in 8 tokens.
TAILS = {8: None, 24: 8}


@pytest.fixture(scope="module")
def float_engines(llama):
    return {c: Prefiller(llama, c, quant=None, cache=GraphCache(), tail_len=TAILS[c]) for c in (8, 24)}


@pytest.fixture(scope="module")
def quant_engines(llama, llama_calib, tmp_path_factory):
    cache = GraphCache(tmp_path_factory.mktemp("graphs"))
    return {c: Prefiller(llama, c, quant=QUANT, calibration=llama_calib, cache=cache, progress=False,
                         tail_len=TAILS[c], **FP32_ATTENTION) for c in (8, 24)}


@pytest.fixture(scope="module")
def quant_reference(llama, llama_calib):
    model = copy.deepcopy(llama.model)
    quantize_(model, llama_calib, QUANT, llama.fingerprint, progress=False)
    return model


@pytest.mark.parametrize("family", FAMILIES)
def test_float_prefill_equals_hf_forward(family):
    lm = load_model(f"random:{family}")
    ids = torch.randint(0, 1000, (150,))      # > 2 sliding windows of 64 for gemma2/gemma3
    result = Prefiller(lm, 32, quant=None, cache=GraphCache())(ids)
    logits, cache = _hf(lm.model, ids)
    assert result.chunks == 5 and result.tokens == 150
    torch.testing.assert_close(result.logits, logits, atol=1e-4, rtol=1e-4)
    _assert_kv_close(result, cache)


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_gets_a_tail_program_that_equals_hf_forward(family):
    """The step captured at the tail's length is cut like the chunk's in every family (sliding
    windows, q/k norms, softcapping included), and a prompt ending on it equals HF's forward."""
    lm = load_model(f"random:{family}")
    ids = torch.randint(0, 1000, (134,))      # 4 chunks of 32, then 6 tokens on the 8-row tail
    engine = Prefiller(lm, 32, quant=None, cache=GraphCache(), tail_len=8)
    result = engine(ids)
    assert engine.tail is not None and result.rows == 4 * 32 + 8
    logits, cache = _hf(lm.model, ids)
    torch.testing.assert_close(result.logits, logits, atol=1e-4, rtol=1e-4)
    _assert_kv_close(result, cache)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 70), chunk=st.sampled_from([8, 24]))
def test_float_chunked_equals_hf_for_any_length(float_engines, llama, length, chunk):
    ids = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length))
    result = float_engines[chunk](ids)
    logits, cache = _hf(llama.model, ids)
    torch.testing.assert_close(result.logits, logits, atol=1e-4, rtol=1e-4)
    _assert_kv_close(result, cache)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 70), chunk=st.sampled_from([8, 24]))
def test_shadow_chunked_equals_unchunked_quantized(quant_engines, quant_reference, llama, length, chunk):
    ids = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length))
    result = quant_engines[chunk](ids)
    logits, cache = _hf(quant_reference, ids)
    float_logits, float_cache = _hf(llama.model, ids)
    # Same integer arithmetic; float sums of the attention differ in order between chunked and whole.
    assert_within_quant_effect(result.logits, logits, float_logits)
    for k, layer, flt in zip(result.past_k, cache.layers, float_cache.layers):
        assert_within_quant_effect(k, layer.keys, flt.keys)


@pytest.fixture(scope="module")
def untailed_engines(llama, llama_calib):
    """Chunk-24 engines without a tail program: quantized like ``quant_engines[24]``, and float."""
    return (Prefiller(llama, 24, quant=QUANT, calibration=llama_calib, cache=GraphCache(), progress=False,
                      tail_len=None, **FP32_ATTENTION),
            Prefiller(llama, 24, quant=None, cache=GraphCache(), tail_len=None))


@pytest.mark.parametrize("length, past, rows", [(29, 0, [24, 8]), (5, 0, [8]), (33, 0, [24, 24]),
                                               (48, 0, [24, 24]), (6, 40, [8]), (20, 40, [24])])
def test_a_short_last_part_runs_on_the_tail_program_as_the_padded_chunk_would(
        quant_engines, untailed_engines, length, past, rows):
    """A last part of at most 8 tokens runs as 8 rows on the tail program (its steps are called:
    counted), a longer one as a padded chunk; against an engine without a tail, on the same
    prompt and past: the same numbers to float rounding (measured: bit-equal on a Zen 4; the INT8
    sums are exact, and only a float kernel's blocking may differ with the rows), where the
    quantization effect is ~3e-2."""
    tailed = quant_engines[24]
    padded, floating = untailed_engines
    ids = torch.randint(0, 1000, (past + length,), generator=torch.Generator().manual_seed(length))
    prefix = padded(ids[:past]) if past else None
    kv = (prefix.past_k, prefix.past_v) if prefix else None
    calls = []
    step = next(s for s in tailed.tail.steps if s.sub.kind == "cpu" and not s.static)   # an attention subgraph
    real = step.fn
    step.fn = lambda *a: calls.append(a[0].shape) or real(*a)
    try:
        got = tailed(ids[past:], past=kv)
    finally:
        step.fn = real
    want = padded(ids[past:], past=kv)
    assert [got.rows, want.rows] == [sum(rows), 24 * len(rows)]
    assert len(calls) == (rows[-1] == 8)
    float_ref = floating(ids[past:], past=kv)
    assert_within_quant_effect(got.logits, want.logits, float_ref.logits)      # and far inside it:
    for a, b in zip([got.logits, *got.past_k, *got.past_v], [want.logits, *want.past_k, *want.past_v]):
        assert float((a - b).abs().max()) <= 1e-5 * float(b.abs().max())
    assert got.tokens == want.tokens == past + length


def test_tail_lengths_and_a_partition_that_differs(llama, monkeypatch, caplog):
    from llmnpu_delegate.runtime import engine as prefill_module
    from llmnpu_delegate.runtime.prompt import chunk_rows

    assert chunk_rows(700, 256, 64) == [256, 256, 256] and chunk_rows(316, 256, 64) == [256, 64]
    assert chunk_rows(512, 256, 64) == [256, 256] and chunk_rows(3, 256, None) == [256]
    assert Prefiller(llama, 64, quant=None).tail_len == 16       # "auto": a quarter of the chunk
    assert Prefiller(llama, 32, quant=None).tail is None         # a quarter would be below TAIL_MIN
    for bad in (24, 30, -1, 2.5, "half"):
        with pytest.raises(LlmNpuError, match="tail_len"):
            Prefiller(llama, 24, quant=None, tail_len=bad)
    engine = Prefiller(llama, 24, quant=None, tail_len=None)
    short = dict(engine.feeds(torch.arange(8))[0], input_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(LlmNpuError, match="chunks of \\[8\\] rows have no program"):
        engine.executor.run([short], "inorder")
    monkeypatch.setattr(prefill_module, "same_subgraphs", lambda a, b: False)
    engine = Prefiller(llama, 24, quant=None, tail_len=8)
    assert engine.tail is None and "partitioned unlike" in caplog.text
    assert engine(torch.arange(5)).rows == 24


def test_shadow_path_is_exercised(quant_engines):
    engine = quant_engines[8]
    kinds = [s.kind for s in engine.partition.subgraphs]
    assert "shadow" in kinds
    engine(torch.randint(0, 1000, (40,)))
    seen = sum(m.outlier_elements for m in engine.program.shadow.values())
    assert seen > 0, "injected outliers never reached the shadow path"


def test_npu_subgraphs_are_int8_only(quant_engines):
    from llmnpu_delegate.backends.cpu_int8 import NpuRegion

    engine = quant_engines[8]
    npu = [s for s in engine.program.steps if s.sub.kind == "npu"]
    assert npu and all(isinstance(s.fn, NpuRegion) for s in npu)
    for step in npu:
        for _, _, linears in step.fn.groups:
            assert all(w.dtype == torch.int8 for w, _, _ in linears.source)


INT8_KERNELS = {"onednn::qlinear_pointwise", "aten::_int_mm", "llmnpu_native::int8_gemm"}
FLOAT_GEMMS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::matmul", "aten::linear",
               "aten::mkldnn_rnn_layer", "mkldnn::_linear_pointwise"}


def test_npu_regions_run_integer_kernels_and_no_float_gemm(quant_engines):
    """Values cannot tell an INT8 GEMM from a float one (float sums of these products are exact
    below 2^24), so this asks the profiler what ran inside each NPU task of the executor."""
    from torch._C._profiler import _ExperimentalConfig
    from torch.profiler import ProfilerActivity, profile

    engine = quant_engines[8]
    with profile(activities=[ProfilerActivity.CPU], experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
        result = engine(torch.randint(0, 1000, (20,)))

    def below(event):
        for child in event.cpu_children:
            yield child.name
            yield from below(child)

    regions = [e for e in prof.events() if e.name.startswith("llmnpu.")]
    npu = [e for e in regions if e.name.startswith("llmnpu.npu")]
    assert len(npu) == sum(t.processor == "npu" for t in build_tasks(engine.program, result.chunks))
    for region in npu:
        ops = set(below(region))
        assert ops & INT8_KERNELS, f"{region.name} ran no integer GEMM: {sorted(ops)}"
        assert not ops & FLOAT_GEMMS, f"{region.name} ran a float GEMM: {sorted(ops & FLOAT_GEMMS)}"
    # the float work is where it belongs: some CPU task runs a float product (the shadow path)
    assert any(set(below(e)) & FLOAT_GEMMS for e in regions if e.name.startswith("llmnpu.cpu"))


def test_second_prompt_of_another_length_compiles_nothing(llama, llama_calib, tmp_path):
    cache = GraphCache(tmp_path)
    engine = Prefiller(llama, 16, quant=QUANT, calibration=llama_calib, cache=cache, progress=False)
    npu = len(engine.partition.by_kind("npu"))
    assert cache.stats.compilations == npu and cache.stats.hits == 0
    engine(torch.randint(0, 1000, (37,)))
    engine(torch.randint(0, 1000, (5,)))
    assert cache.stats.compilations == npu
    # A second process (a new engine and a new cache object on the same folder) compiles nothing.
    again = GraphCache(tmp_path)
    Prefiller(llama, 16, quant=QUANT, calibration=llama_calib, cache=again, progress=False)
    assert again.stats.compilations == 0 and again.stats.hits == npu


def test_corrupt_cache_entry_is_rebuilt(llama, llama_calib, tmp_path):
    cache = GraphCache(tmp_path)
    first = Prefiller(llama, 16, quant=QUANT, calibration=llama_calib, cache=cache, progress=False)
    ids = torch.randint(0, 1000, (20,))
    want = first(ids).logits
    victim = sorted(tmp_path.glob("*.pt"))[0]
    victim.write_bytes(victim.read_bytes()[:100])
    again = GraphCache(tmp_path)
    second = Prefiller(llama, 16, quant=QUANT, calibration=llama_calib, cache=again, progress=False)
    assert again.stats.rebuilt == 1 and again.stats.compilations == 1
    torch.testing.assert_close(second(ids).logits, want)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "a temporary file was left behind"


def test_cache_entry_of_another_format_is_not_trusted(tmp_path):
    cache = GraphCache(tmp_path)
    payload = cache.get_or_build({"x": 1}, lambda: {"w": torch.ones(3)})
    path = next(tmp_path.glob("*.pt"))
    entry = load_checked(path, "graph-cache-entry")
    entry["format"] = 999
    save_checked(entry, path, "graph-cache-entry")
    again = GraphCache(tmp_path)
    rebuilt = again.get_or_build({"x": 1}, lambda: {"w": torch.ones(3)})
    assert again.stats.rebuilt == 1 and torch.equal(rebuilt["w"], payload["w"])


def test_concurrent_writers_leave_a_valid_entry(tmp_path):
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_build_entry, args=(str(tmp_path),)) for _ in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    cache = GraphCache(tmp_path)
    out = cache.get_or_build({"entry": "shared"}, lambda: pytest.fail("the entry should be on disk"))
    assert torch.equal(out["w"], torch.arange(1000.0)) and cache.stats.compilations == 0


def _build_entry(root: str) -> None:
    cache = GraphCache(root)
    for _ in range(20):
        cache._memory.clear()
        cache.get_or_build({"entry": "shared"}, lambda: {"w": torch.arange(1000.0)})


def test_a_model_edited_in_a_middle_block_gets_its_own_artefacts(tmp_path):
    """Every weight is in the fingerprint: one element changed in a middle block gives a new key, so
    a new calibration and new compiled graphs, and outputs that follow the edit (hashing only the
    first and last blocks reused the old model's INT8 weights and scales)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from llmnpu_delegate.models import RANDOM_SHAPES, LoadedModel, fingerprint
    from llmnpu_delegate.quantize import load_or_calibrate

    family, kwargs = RANDOM_SHAPES["tiny-llama"]
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **{**kwargs, "num_hidden_layers": 3})).eval()
    inject_outliers(base)
    edited = copy.deepcopy(base)
    with torch.no_grad():
        edited.model.layers[1].mlp.down_proj.weight[5, 7] += 2.0
    calib_ids = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    cfg = CalibConfig(samples=4, tokens=64, probe_tokens=64)
    cache = GraphCache(tmp_path)
    ids = torch.randint(0, 1000, (30,))
    logits, calibs = [], []
    for model in (base, edited):
        lm = LoadedModel("edited", model, None, fingerprint(model))
        calibs.append(load_or_calibrate(model, calib_ids, lm.fingerprint, cfg, progress=False))
        before = cache.stats.compilations
        engine = Prefiller(lm, 8, quant=QUANT, calibration=calibs[-1], cache=cache, progress=False,
                           **FP32_ATTENTION)
        assert cache.stats.compilations - before == len(engine.partition.by_kind("npu")), "served stale graphs"
        logits.append(engine(ids).logits)
    assert calibs[0].model_fingerprint != calibs[1].model_fingerprint and calibs[0].path != calibs[1].path
    reference = copy.deepcopy(edited)
    quantize_(reference, calibs[1], QUANT, calibs[1].model_fingerprint, progress=False)
    want, flt = _hf(reference, ids)[0], _hf(edited, ids)[0]
    assert_within_quant_effect(logits[1], want, flt)
    assert (logits[1] - logits[0]).abs().max() > 10 * (logits[1] - want).abs().max()


def test_an_engine_built_after_a_module_swap_computes_the_new_module():
    """A process keeps one capture of a model's chunk step per length (its trial engines share it):
    a second engine of the same model reuses it, and one built after a linear is replaced by another
    captures again and equals HF's forward of the changed model."""
    from llmnpu_delegate.chunk_step import export_chunk_step

    lm = load_model("random:tiny-llama")
    assert export_chunk_step(lm.model, 8) is export_chunk_step(lm.model, 8)
    ids = torch.randint(0, 1000, (20,))
    before = Prefiller(lm, 8, quant=None, tail_len=None)(ids).logits
    old = lm.model.model.layers[1].mlp.down_proj
    new = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    lm.model.model.layers[1].mlp.down_proj = new
    got = Prefiller(lm, 8, quant=None, tail_len=None)(ids).logits
    want = _hf(lm.model, ids)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert (got - before).abs().max() > 100 * (got - want).abs().max()


def test_prefill_function_reuses_its_engine(llama):
    a = prefill(llama, torch.randint(0, 1000, (10,)), chunk_len=8, quant=None)
    b = prefill(llama, torch.randint(0, 1000, (30,)), chunk_len=8, quant=None)
    assert a.chunks == 2 and b.chunks == 4 and b.logits.shape == (llama.model.config.vocab_size,)


@pytest.mark.parametrize("ids, message", [
    (torch.zeros(0, dtype=torch.long), "empty"),
    (torch.zeros(4097, dtype=torch.long), "context"),
    (torch.zeros(2, 3, dtype=torch.long), "batch"),
    (torch.full((3,), 10 ** 6), "token ids"),
])
def test_bad_prompts_are_refused(float_engines, ids, message):
    with pytest.raises(LlmNpuError, match=message):
        float_engines[8](ids)


@pytest.mark.parametrize("chunk", [0, -4, 5000])
def test_bad_chunk_lengths_are_refused(llama, chunk):
    with pytest.raises(LlmNpuError, match="chunk length"):
        Prefiller(llama, chunk, quant=None)


def test_backend_and_policy_errors(llama):
    with pytest.raises(LlmNpuError, match="unknown backend"):
        Prefiller(llama, 8, backend="hexagon", quant=None)
    with pytest.raises(LlmNpuError, match="unknown placement 'npu'"):
        Prefiller(llama, 8, quant=None, placement="npu")
    with pytest.raises(LlmNpuError, match="unknown quantization"):
        Prefiller(llama, 8, quant="int4")


@pytest.mark.parametrize("family", FAMILIES[1:])
def test_shadow_prefill_equals_quantized_model_for_every_family(family):
    lm = outlier_model(f"random:{family}")
    calib = calibrate(lm.model, torch.randint(0, 1000, (256,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    ids = torch.randint(0, 1000, (100,))
    engine = Prefiller(lm, 32, quant=QUANT, calibration=calib, cache=GraphCache(), progress=False,
                       **FP32_ATTENTION)
    assert engine.partition.by_kind("shadow")
    got = engine(ids).logits
    reference = copy.deepcopy(lm.model)
    quantize_(reference, calib, QUANT, lm.fingerprint, progress=False)
    want, _ = _hf(reference, ids)
    assert_within_quant_effect(got, want, _hf(lm.model, ids)[0])


def _int64_reference_gap(llama, llama_calib, engine, ids):
    """(|engine - int64 reference|, quantization effect) on the logits of ``ids``."""
    reference = on_int64(Prefiller, llama, engine.chunk_len, quant=QUANT, calibration=llama_calib,
                         cache=GraphCache(), progress=False, **FP32_ATTENTION)
    want = on_int64(reference, ids).logits
    got = engine(ids).logits
    effect = float((want - _hf(llama.model, ids)[0]).abs().max())
    return float((got - want).abs().max()), effect


def test_int8_engine_equals_an_int64_reference(quant_engines, llama, llama_calib):
    """Whichever INT8 kernel this CPU runs, the engine equals the same engine computing every INT8
    linear with int64 arithmetic (same integers; at most the epilogue's float rounding differs)."""
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3))
    gap, effect = _int64_reference_gap(llama, llama_calib, quant_engines[8], ids)
    assert effect > 0 and gap <= effect / 1000, (gap, effect)


def test_int64_reference_catches_a_saturating_kernel(llama, llama_calib, saturating_kernel):
    """The check above, with the kernel swapped for a model of the saturating one: it fails by far."""
    engine = Prefiller(llama, 8, quant=QUANT, calibration=llama_calib, cache=GraphCache(), progress=False,
                       **FP32_ATTENTION)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3))
    gap, effect = _int64_reference_gap(llama, llama_calib, engine, ids)
    assert gap > effect / 1000, (gap, effect)
