"""`llmnpu export --backend cpu-int8`: one .pte of NPU (XNNPACK INT8) and CPU (portable) methods plus a
sidecar, checked against the cpu-int8 engine, and the reference runner that prefills from the .pte alone."""
import json
import math
import os
import random
import shutil
import struct

import pytest
import torch
from conftest import TINY_CHUNK, tiny_engine
from hypothesis import HealthCheck, example, given, settings, strategies as st
from test_artefacts import BYTES, damage_bytes, mutated, structure

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.format.sidecar import sidecar_digest, sidecar_path
from llmnpu_delegate.lower.export_config import ExportConfig
from llmnpu_delegate.lower.pte import export_pte
from llmnpu_delegate.models import load_model
from llmnpu_delegate.runtime.pte_runner import PteRunner
from llmnpu_delegate.runtime.sampling import Sampling
from llmnpu_delegate.runtime.validate import sqnr_db, validate_pte

CHUNK = TINY_CHUNK


@pytest.fixture(scope="module")
def engine():
    return tiny_engine()


@pytest.fixture(scope="module")
def exported(engine, tmp_path_factory):
    out = tmp_path_factory.mktemp("pte") / "tiny.pte"
    calib_ids = torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(2))
    summary = export_pte(engine, out, calib_ids,
                         ExportConfig(target="cpu-int8", context=4 * CHUNK, decode="fp32"),
                         model={"spec": "random:tiny-llama"}, progress=False,
                         tokenizer=load_model("random:tiny-llama").tokenizer, workers=2)
    return out, summary


def test_one_method_per_subgraph_and_a_sidecar_with_what_a_runner_needs(engine, exported):
    out, summary = exported
    # no temporaries left
    # (and no rows file: the program's INT8 weights are its cold rows, ``shadow.rows_in_program``)
    assert sorted(p.name for p in out.parent.iterdir()) == ["tiny.json", "tiny.pte", "tiny.tokenizer"]
    meta = json.loads(sidecar_path(out).read_text())
    runner = PteRunner(out)
    steps = engine.program.steps
    assert runner.lanes["npu"].method_names == {e["method"] for e in meta["subgraphs"]} | {"decode"}
    assert [e["inputs"] for e in meta["subgraphs"]] == [s.sub.inputs for s in steps]
    assert [e["outputs"] for e in meta["subgraphs"]] == [s.sub.outputs for s in steps]
    assert summary["npu_methods"] == sum(s.sub.kind == "npu" for s in steps) > 0
    assert meta["chunk_len"] == CHUNK and meta["context"] == 4 * CHUNK
    # the export's config, recorded as given: a program says how it was made
    config = ExportConfig.from_dict(meta["export"])
    assert config == ExportConfig(target="cpu-int8", context=4 * CHUNK, decode="fp32")
    assert (config.context_for(10**6), config.bits) == (meta["context"], 32)
    plans = engine.plans
    assert set(meta["linears"]) == set(plans)
    for name, lin in meta["linears"].items():
        assert lin["act_scale"] == pytest.approx(plans[name].act_scale, rel=1e-12)
        assert lin["shadow"] == plans[name].shadow
        if plans[name].shadow:
            assert lin["clip"] == pytest.approx(plans[name].clip) and lin["hot_channels"] == plans[name].hot.tolist()
        # cpu-int8's default: float outputs, nothing split
        assert lin["output"] == {"bits": 32} and lin["split_channels"] == [] == lin["split_outputs"] == lin["fine_outputs"]
    assert summary["output_bits"] == 32
    assert meta["pruned_layers"] == sorted(n for n, p in plans.items() if not p.shadow)
    assert 0 < len(meta["pruned_layers"]) < len(plans)          # both kinds present in this plan
    assert meta["profile"]["static"] and meta["profile"]["dynamic"]


def test_npu_methods_compute_the_engines_integer_products(engine, exported):
    """Float-output NPU methods on the engine's own input rows: every output element is the engine's
    int32 accumulator (steps are accumulator units here; the 8-bit outputs of the same regions were
    up to 0.5 output steps and 30 dB apart, measured)."""
    eval_ids = torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(3))
    report = validate_pte(exported[0], engine, eval_ids)
    assert len(report["linears"]) == len(engine.plans)
    assert max(r["max_steps"] for r in report["linears"]) < 0.5, report["linears"]   # measured: 0.01
    assert report["prefill"]["chunks"] == 2 and report["prefill"]["logits_sqnr_db"] > 50


@pytest.mark.parametrize("tokens", [20, 70, 128])        # 1, 3 and 4 chunks (the whole context)
def test_reference_runner_prefills_like_the_engine(engine, exported, tokens):
    ids = torch.randint(0, 1000, (tokens,), generator=torch.Generator().manual_seed(tokens))
    runner = PteRunner(exported[0])
    ours, want = runner(ids), engine(ids)
    assert ours.chunks == want.chunks and ours.tokens == want.tokens == tokens
    # the same integer products and float work in another order: measured 134-136 dB (logits within
    # 2.4e-7 of |0.7|); 8-bit outputs were 22-26 dB. 50 dB leaves room for a rounding flipped by
    # another CPU's float kernels, not for a requantized output
    assert sqnr_db(ours.logits, want.logits) > 50
    assert min(sqnr_db(a, b) for a, b in zip(ours.past_k + ours.past_v, want.past_k + want.past_v)) > 50
    inorder = runner(ids, policy="inorder")
    assert torch.equal(inorder.logits, ours.logits) and runner.last_run.policy == "inorder"


def test_reference_runner_continues_a_past_like_the_whole_prompt(exported):
    """A prompt after a past that ends mid-chunk (45 = 1 chunk + 13), through ``past=`` and through
    the prefix cache: the K/V and logits of the whole 70-token prompt prefilled at once."""
    from llmnpu_delegate.runtime.prefix_cache import PrefixCache

    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(70))
    runner = PteRunner(exported[0])
    whole, head = runner(ids), runner(ids[:45])
    rest = runner(ids[45:], past=(head.past_k, head.past_v))
    assert rest.reused == 45 and rest.tokens == 70 and rest.chunks == 1
    cached = PteRunner(exported[0], prefix_cache=PrefixCache())
    cached(ids[:45])
    again = cached(ids)
    assert again.reused == 45
    for got in (rest, again):
        torch.testing.assert_close(got.logits, whole.logits, atol=1e-5, rtol=0)
        for a, b in zip(got.past_k + got.past_v, whole.past_k + whole.past_v):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    # a short continuation (the 25 new tokens) costs one chunk, not the three of the whole prompt
    assert whole.chunks == 3


def test_identical_cpu_subgraphs_share_one_method(exported):
    """Subgraphs that compute the same program name one method (the first's), on one lane; the .pte
    holds each method once. (The runner tests above prefill through the shared methods.)"""
    meta = PteRunner(exported[0]).meta
    cpu = [e for e in meta["subgraphs"] if e["kind"] != "npu"]
    shared = [e for e in cpu if e["method"] != f"cpu_{e['index']}"]
    assert shared, "tiny-llama's two layers repeat their attention and activation subgraphs"
    by_name = {e["method"]: e for e in cpu if e["method"] == f"cpu_{e['index']}"}
    for e in shared:
        first = by_name[e["method"]]
        assert first["index"] < e["index"] and first["processor"] == e["processor"]
        assert (len(first["inputs"]), len(first["outputs"])) == (len(e["inputs"]), len(e["outputs"]))
    assert exported[1]["cpu_methods"] == len(by_name) < exported[1]["cpu_subgraphs"] == len(cpu)


def test_export_keeps_no_lowered_program_alive(engine, tmp_path):
    """Each method is emitted as soon as it is lowered and its lowered form let go: after an export,
    no lowered module it made still holds the float program it came from (torch's and ExecuTorch's
    process-wide caches kept every one of them, and the export's memory grew with each method)."""
    import gc

    from executorch.exir.lowered_backend_module import LoweredBackendModule

    def holding():
        gc.collect()
        return {id(m) for m in gc.get_objects()
                if isinstance(m, LoweredBackendModule) and m.original_module is not None}

    before = holding()
    export_pte(engine, tmp_path / "tiny.pte", torch.randint(0, 1000, (3 * CHUNK,)),
               ExportConfig(target="cpu-int8", context=4 * CHUNK, decode="int8"), progress=False, workers=1)
    assert holding() - before == set()


def test_one_process_writes_the_workers_program_from_rows_on_disk_and_lets_the_engine_go(exported, tmp_path,
                                                                                         monkeypatch):
    """One export, three properties:
    - its methods lowered in this process alone give the bytes of the fixture's two forked workers,
      whichever worker lowered a shared method first;
    - the NPU subgraphs' calibration rows are files while the jobs lower, not tensors the parent holds
      beside them (0.8 GiB of a 1.8B model's export), each read and removed by its own job;
    - ``llmnpu export`` lets the engine's runtime go once the examples are taken (the workers then
      share less memory): no compiled step left (their INT8 weights and shadow rows go with them: the
      executor's threads kept their last prefill), and a prompt is refused in one line."""
    import gc
    import weakref

    from llmnpu_delegate.lower import pte

    handed = {}
    run_jobs = pte.run_jobs

    def spy(fn, state, jobs, workers, **kwargs):
        handed.update(state.rows)
        yield from run_jobs(fn, state, jobs, workers, **kwargs)

    monkeypatch.setattr(pte, "run_jobs", spy)
    eng = tiny_engine()
    npu = [i for i, step in enumerate(eng.program.steps) if step.sub.kind == "npu"]
    steps = [weakref.ref(step.fn) for step in eng.program.steps]
    out = tmp_path / "tiny.pte"
    alone = export_pte(eng, out, torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(2)),
                       ExportConfig(target="cpu-int8", context=4 * CHUNK, decode="fp32"),
                       model={"spec": "random:tiny-llama"}, progress=False,
                       tokenizer=load_model("random:tiny-llama").tokenizer, workers=1, release_engine=True)
    assert alone["workers"] == 1 and exported[1]["workers"] == 2
    assert out.read_bytes() == exported[0].read_bytes()
    assert sidecar_path(out).read_text() == sidecar_path(exported[0]).read_text()
    assert sorted(handed) == npu and all(isinstance(f, str) for f in handed.values())
    assert not any(os.path.exists(f) for f in handed.values())
    assert all(step.fn is None for step in eng.program.steps) and not eng.program.shadow
    gc.collect()
    assert [i for i, step in enumerate(steps) if step() is not None] == []     # nothing else holds them
    with pytest.raises(LlmNpuError, match="released"):
        eng(torch.arange(CHUNK))


class _Norm(torch.nn.Module):
    def __init__(self, weight, eps=1e-6):
        super().__init__()
        self.weight, self.eps = torch.nn.Parameter(weight), eps

    def forward(self, x, y):
        h = x + y
        return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def test_program_key_sees_computation_not_names():
    """Same ops, shapes and constants: one key, whatever the inputs and weights are called. A different
    constant, scalar or shape: another key (a key blind to them would share a layer's norm with
    another's)."""
    from llmnpu_delegate.lower.shared_methods import program_key

    x = (torch.randn(4, 8), torch.randn(4, 8))
    w = torch.randn(8)

    def key(module, args=x):
        return program_key(torch.export.export(module, args, strict=False))

    class Renamed(_Norm):
        def forward(self, a, b):
            return super().forward(a, b)

    base = key(_Norm(w.clone()))
    assert key(Renamed(w.clone())) == base
    w2 = w.clone()
    w2[3] += 1e-3
    assert key(_Norm(w2)) != base
    assert key(_Norm(w.clone(), eps=1e-5)) != base
    assert key(_Norm(w.clone()), (torch.randn(5, 8), torch.randn(5, 8))) != base


class _Past(torch.nn.Module):
    def forward(self, x, past):
        return torch.cat([past, x], 0).softmax(0)


class _RenamedPast(torch.nn.Module):
    def forward(self, y, cache_of_layer_7):
        return torch.cat([cache_of_layer_7, y], 0).softmax(0)


def test_program_key_is_blind_to_how_an_export_numbers_its_symbols():
    """Each export names its symbolic sizes anew (another argument name, another symbol: s1 vs s37 here,
    as the attention of two layers differed); the key renames them in order. The bound a size was exported
    with still counts: it sizes the method's planned memory."""
    from torch.export import Dim

    from llmnpu_delegate.lower.shared_methods import program_key

    x, past = torch.randn(4, 8), torch.randn(6, 8)

    def export(module, high=64):
        return torch.export.export(module, (x, past), dynamic_shapes=[None, {0: Dim("p", min=0, max=high)}], strict=False)

    first, renamed = export(_Past()), export(_RenamedPast())
    sizes = {str(n.meta["val"].shape[0]) for ep in (first, renamed) for n in ep.graph.nodes
             if n.op == "placeholder" and n.name in ("past", "cache_of_layer_7")}
    assert len(sizes) == 2, sizes          # the case this guards against happens: two symbols for one size
    assert program_key(first) == program_key(renamed)
    assert program_key(export(_Past(), high=128)) != program_key(first)


def test_each_lane_shares_one_arena_and_hands_out_copies(exported):
    """The runner loads one program per lane, every method of a lane in that lane's program (one planned
    arena for all of them), and a method's outputs survive the lane's next method: they were copied out
    of the arena, which that next method overwrites."""
    runner = PteRunner(exported[0])
    meta = runner.meta
    loaded = {p: {m for m, method in prog._methods.items() if method is not None} for p, prog in runner.lanes.items()}
    for e in meta["subgraphs"]:       # loaded in its own lane's program, and not in the other's
        assert e["method"] in loaded[e["processor"]] and e["method"] not in loaded[{"npu": "cpu", "cpu": "npu"}[e["processor"]]]
    npu = [e for e in meta["subgraphs"] if e["kind"] == "npu"]
    assert len(npu) >= 2
    lane = runner.lanes["npu"]

    def inputs(method, gain=1.0):
        m = lane.metadata(method)
        return [torch.randn(*m.input_tensor_meta(i).sizes()) * gain for i in range(m.num_inputs())]

    first, second = lane.load_method(npu[0]["method"]), lane.load_method(npu[1]["method"])
    x = inputs(npu[0]["method"])
    outs = first.execute(x)
    kept = [o.clone() for o in outs]
    second.execute(inputs(npu[1]["method"], 100.0))
    assert all(torch.equal(a, b) for a, b in zip(outs, kept))
    assert all(torch.equal(a, b) for a, b in zip(first.execute(x), kept))      # and the arena is reused


def test_bad_artefacts_and_prompts_are_refused(exported, tmp_path):
    out = exported[0]
    runner = PteRunner(out)
    with pytest.raises(LlmNpuError, match="more than the context of 128"):
        runner(torch.zeros(129, dtype=torch.long))
    with pytest.raises(LlmNpuError, match="no such .pte"):
        PteRunner(tmp_path / "missing.pte")
    lonely = tmp_path / "lonely.pte"
    shutil.copy(out, lonely)
    with pytest.raises(LlmNpuError, match="no sidecar lonely.json"):
        PteRunner(lonely)
    other = tmp_path / "other.pte"
    other.write_bytes(out.read_bytes() + b"\0")
    shutil.copy(sidecar_path(out), sidecar_path(other))
    with pytest.raises(LlmNpuError, match="do not match"):
        PteRunner(other)
    sidecar_path(other).write_text("{not json")
    with pytest.raises(LlmNpuError, match="not valid JSON"):
        PteRunner(other)


def test_a_method_the_runtime_cannot_load_is_one_line(exported, monkeypatch):
    """A delegate that refuses to initialise a method (the HTP simulator out of memory for a
    chunk-1,024 program's contexts) says why only in its log; the runner names the method in one
    line instead of a traceback from ExecuTorch."""
    from executorch.runtime import Program

    meta = PteRunner(exported[0]).meta
    method = meta["subgraphs"][3]["method"]
    load = Program.load_method

    def refuse(self, name):
        if name == method:
            raise RuntimeError(f"Failed to load method {name}, error: 0x:1")
        return load(self, name)
    monkeypatch.setattr(Program, "load_method", refuse)
    with pytest.raises(LlmNpuError) as err:
        PteRunner(exported[0])
    assert f"method {method} did not load" in str(err.value) and "\n" not in str(err.value)


def test_export_refuses_bad_requests_before_writing(engine, tmp_path):
    ids = torch.randint(0, 1000, (3 * CHUNK,))
    with pytest.raises(LlmNpuError, match="unknown backend 'gpu': use one of cpu-int8, qnn"):
        export_pte(engine, tmp_path / "a.pte", ids, ExportConfig(target="gpu"))
    for bad, match in (({"shadow": "half"}, "unknown shadow branch form"), ({"decode": "int4"}, "unknown decode mode"),
                       ({"output_bits": 16}, "not 16"), ({"context": 2.5}, "context must be an integer"),
                       ({"soc": "SM1234"}, "SM1234"), ({"residual_bits": 12}, "residual_bits must be one of 8, 16"),
                       ({"target": "cpu-int8", "soc": None, "residual_bits": 16}, "use --residual-bits 8")):
        with pytest.raises(LlmNpuError, match=match):
            ExportConfig(**{"target": "qnn", **bad})
    with pytest.raises(LlmNpuError, match="unknown fields"):
        ExportConfig.from_dict({"target": "cpu-int8", "bits": 8})
    with pytest.raises(LlmNpuError, match="context must be an integer"):
        export_pte(engine, tmp_path / "a.pte", ids, ExportConfig(target="cpu-int8", context=CHUNK - 1))
    with pytest.raises(LlmNpuError, match="at least 96 calibration tokens"):
        export_pte(engine, tmp_path / "a.pte", ids[:50], ExportConfig(target="cpu-int8"))
    with pytest.raises(LlmNpuError, match="not fp32"):
        export_pte(tiny_engine(quant=None), tmp_path / "a.pte", ids, ExportConfig(target="cpu-int8"))
    with pytest.raises(LlmNpuError, match="workers must be a positive number"):
        export_pte(engine, tmp_path / "a.pte", ids, ExportConfig(target="cpu-int8"), workers=0)
    assert not any(tmp_path.iterdir())


def test_validate_refuses_an_engine_that_was_not_exported(exported):
    other = tiny_engine(quant="w8a8")          # same model, other activation scales
    with pytest.raises(LlmNpuError, match="activation scale of .* differs"):
        validate_pte(exported[0], other, torch.randint(0, 1000, (CHUNK,)))


def test_export_and_validate_commands_cpu_int8(tmp_path, capsys):
    """The commands end to end on a tiny model (default calibration text, context 96)."""
    from llmnpu_delegate.cli import main

    out = tmp_path / "tiny.pte"
    assert main(["export", "--model", "random:tiny-llama", "--backend", "cpu-int8", "--chunk", "32",
                 "--context", "96", "--output-bits", "8", "--out", str(out), "--no-progress", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["target"] == "cpu-int8" and summary["context"] == 96 and summary["soc"] is None
    assert summary["output_bits"] == 8      # requantized outputs, as an integer NPU graph gives them
    assert out.stat().st_size == summary["pte_bytes"] and sidecar_path(out).is_file()
    code = main(["validate", "--pte", str(out), "--no-progress", "--json"])
    captured = capsys.readouterr()
    assert code == 0, captured.err      # 1 would mean the program predicts another next token
    report = json.loads(captured.out)
    assert report["prefill"]["same_next_token"]
    assert report["target"] == "cpu-int8" and report["prefill"]["chunks"] == 2
    assert min(r["within_2_steps"] for r in report["linears"]) >= 0.99


def test_an_output_holding_two_scales_gets_a_second_finer_encoding():
    """A row whose inputs all line up with channel 7's weights (an attention sink) drives it to ~110x
    its ordinary values, on one row in 128: one 8-bit encoding sized for that row leaves the
    ordinary rows a few steps. The export gives channel 7 a second encoding over its 99 % range, and
    the merge takes the fine value where it did not saturate: the ordinary rows gain the resolution,
    the sink rows keep the coarse value."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from llmnpu_delegate.lower.npu_subgraphs import fine_outputs, lower_region, output_groups, region_spec
    from llmnpu_delegate.quantize.apply import LinearPlan

    torch.manual_seed(0)
    lin = torch.nn.Linear(1024, 48)
    rows = torch.randn(256, 1024).clamp(-4, 4)
    rows[::128] = 4 * lin.weight[7].detach().sign()
    splits = output_groups(lin, rows)
    assert splits == [[7]]
    fine = fine_outputs(lin, rows, splits, "xnnpack")
    assert [part for part, _ in fine] == [1]        # the sink channel; the main output holds its rows well
    plans = {"l": LinearPlan(4 / 127)}
    x = rows[128:160]                                # a call of 32 rows, the first a sink
    want = torch.nn.functional.linear(x, lin.weight, lin.bias).detach()
    got, coarse_step = {}, None
    for with_fine in (False, True):
        spec = region_spec("forward", ["l"], plans, {0: splits}, {0: fine} if with_fine else None, "xnnpack")
        edge, encodings = lower_region(spec, [lin], plans, "channel", rows, 32, "cpu-int8")
        assert len(encodings) == 2 + with_fine
        coarse_step = encodings[1].scale
        buffer = edge.to_executorch().buffer       # held: the loaded program reads it
        pte = _load_for_executorch_from_buffer(buffer)
        (got[with_fine],) = spec.merge(tuple(o.clone() for o in pte.run_method("forward", spec.grid_inputs(x))))
    ordinary = want[1:, 7]
    assert want[0, 7] > 100 * ordinary.abs().mean()
    one, two = sqnr_db(got[False][1:, 7], ordinary), sqnr_db(got[True][1:, 7], ordinary)
    assert one < 20 and two > one + 10, (one, two)
    assert abs(float(got[True][0, 7] - want[0, 7])) < coarse_step   # the sink row: the coarse value
    others = [c for c in range(48) if c != 7]
    assert torch.equal(got[True][:, others], got[False][:, others])


def test_outsized_output_channels_get_their_own_encoding():
    """Two output channels with 100-300x the others' range: split out, each gets its own output
    encoding, and the ordinary channels keep their resolution (the embedded model's down_proj case)."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from llmnpu_delegate.lower.npu_subgraphs import lower_region, output_groups, region_spec
    from llmnpu_delegate.quantize.apply import LinearPlan

    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 48)
    with torch.no_grad():
        lin.weight[5] *= 300
        lin.weight[30] *= 100
    rows = torch.randn(64, 64)
    assert output_groups(lin, rows) == [[5], [30]]          # 3x apart: one encoding each
    plans = {"l": LinearPlan(float(rows.abs().max()) / 127)}
    want = torch.nn.functional.linear(rows[:32], lin.weight, lin.bias).detach()
    ordinary = [c for c in range(48) if c not in (5, 30)]
    quality = {}
    for splits in ({}, {0: [[5], [30]]}):
        spec = region_spec("forward", ["l"], plans, splits)
        edge, scales = lower_region(spec, [lin], plans, "channel", rows, 32, "cpu-int8")
        assert len(scales) == 1 + len(splits.get(0, []))   # an encoding per output   # an encoding per output
        buffer = edge.to_executorch().buffer
        pte = _load_for_executorch_from_buffer(buffer)
        (got,) = spec.merge(tuple(o.clone() for o in pte.run_method("forward", spec.inputs(rows[:32]))))
        assert got.shape == want.shape
        quality[bool(splits)] = (sqnr_db(got[:, ordinary], want[:, ordinary]), sqnr_db(got, want))
    assert quality[True][0] > 25 and quality[True][0] > quality[False][0] + 15, quality
    assert quality[True][1] > 25, quality


def test_the_split_of_outsized_channels_does_not_depend_on_the_calibration_rows():
    """Ordinary channels with a heavy tail (Student's t, 3 degrees): their maxima grow with the rows,
    from ~13 on 768 to ~21 on 3,072 (three chunks of 256 or of 1,024). Two channels reach 150 on one
    row (a sink token), whatever the count. Both counts split those two off: measured against the
    channels' maxima, the longer calibration would not (150 < 8 x 21), and the rest of the output
    would keep a step 3x coarser."""
    from llmnpu_delegate.lower.npu_subgraphs import output_groups

    torch.manual_seed(0)
    rows = torch.distributions.StudentT(3.0).sample((3072, 64))
    rows[0, [3, 9]] = 150.0
    lin = torch.nn.Linear(64, 64, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.eye(64))
    for n in (768, 3072):
        groups = output_groups(lin, rows[:n])
        assert groups and {3, 9} <= set(groups[0]), (n, groups)
        assert len(groups[0]) < 8, (n, groups)        # the outsized few, not the bulk


def test_float_outputs_are_the_integer_product_of_our_codes():
    """A float-output NPU method (``output_bits=32``) on XNNPACK against the integer product computed
    here: our static codes of the input (clamp(round(x / s), +-127)) times our INT8 weights, in units
    of the int32 accumulator. Two input groups of different scales; rows whose own range is far below
    the grid's (a dynamic scale of their own would be finer) and rows beyond it (clamped)."""
    from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer

    from llmnpu_delegate.lower.npu_subgraphs import lower_region, region_spec
    from llmnpu_delegate.quantize.apply import LinearPlan
    from llmnpu_delegate.quantize.linear import quantize_weight

    torch.manual_seed(1)
    lins = [torch.nn.Linear(96, 40, bias=False), torch.nn.Linear(96, 24, bias=True)]
    plans = {"a": LinearPlan(0.02), "b": LinearPlan(0.05)}
    rows = torch.randn(64, 96)
    rows[:8] *= 0.01                          # a range of ~2 codes: only the sentinels keep the scale
    rows[8:12, :5] *= 40.0                    # beyond +-127 codes of both scales: clamped
    spec = region_spec("forward", ["a", "b"], plans)
    assert spec.groups == [[0], [1]]
    edge, encodings = lower_region(spec, lins, plans, "channel", rows, 32, "cpu-int8", output_bits=32)
    assert encodings == [None, None]
    buffer = edge.to_executorch().buffer        # the loaded program reads it: keep it alive
    pte = _load_for_executorch_from_buffer(buffer)
    for block in rows.split(32):
        got = pte.run_method("forward", spec.grid_inputs(block))
        for lin, scale, y in zip(lins, spec.scales, got):
            w_q, w_scale = quantize_weight(lin.weight.detach(), "channel")
            codes = torch.clamp(torch.round(block / scale), -127, 127).long()
            acc = codes @ w_q.long().T
            bias = lin.bias.detach() if lin.bias is not None else 0.0
            units = (y - bias) / (scale * w_scale.float())
            off = (units.double() - acc.double()).abs()
            # every element rounds to the integer accumulator (float32 rounding of ~1e6 units: < 0.1);
            # one input code off would move it by a whole weight code
            assert float(off.max()) < 0.5, float(off.max())


def test_dense_shadow_paths_add_back_what_clipping_removed():
    """add_shadow_paths on an exported graph: y + linear(x - clamp(x), W), computed independently."""
    from llmnpu_delegate.lower.shadow_branches import add_shadow_paths
    from llmnpu_delegate.quantize.apply import LinearPlan

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.up = torch.nn.Linear(16, 32, bias=False)
            self.down = torch.nn.Linear(32, 16, bias=False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x))) + x

    block = Block().eval()
    x = torch.randn(4, 16)
    x[:, 3] *= 40.0                                       # an outlier channel beyond the clip
    gm = torch.export.export(block, (x,), strict=True).module()
    added = add_shadow_paths(gm, {"up": LinearPlan(act_scale=0.1, clip=2.0), "down": LinearPlan(act_scale=0.1)})
    assert added == ["up"]
    with torch.no_grad():
        h = block.up(x) + block.up(x - x.clamp(-2.0, 2.0))
        want = block.down(torch.relu(h)) + x
        got = gm(x)
    assert (x.abs() > 2.0).any() and not torch.allclose(block(x), want)   # the branch changes the result
    torch.testing.assert_close(got, want)


# --------------------------------------------------------------------------- generation from the .pte alone
def _cli(capsys, *argv):
    from llmnpu_delegate.cli import main

    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def _copy_program(src, dst_dir):
    """The .pte and the files beside it, copied as a user would."""
    for p in src.parent.iterdir():
        if p.name.startswith(src.stem + "."):
            (shutil.copytree if p.is_dir() else shutil.copy)(p, dst_dir / p.name)
    return dst_dir / src.name


def test_run_pte_generates_from_the_program_alone(exported, tmp_path, capsys, monkeypatch):
    """With the cache folder emptied: no model, weights, calibration or tokenizer from anywhere else."""
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path / "empty-cache"))
    pte = _copy_program(exported[0], tmp_path)
    code, out, err = _cli(capsys, "run", "--pte", pte, "--prompt", "The harbour at dawn", "--max-new-tokens", 6,
                          "--json")
    assert code == 0, err
    s = json.loads(out)
    assert s["new_tokens"] == len(s["tokens"]) == 6 and s["prompt_tokens"] > 2 and s["chunks"] == 1
    assert s["decode_mode"].startswith("fp32") and s["ttft_s"] > 0 and s["decode_tok_s"] > 0
    assert not any((tmp_path / "empty-cache").rglob("*.*"))          # nothing was cached or fetched
    # the same tokens as prefill + decode steps driven by hand (greedy), and as a seeded sampler twice
    runner = PteRunner(pte)
    tok = __import__("transformers").AutoTokenizer.from_pretrained(tmp_path / "tiny.tokenizer")
    ids = tok("The harbour at dawn", return_tensors="pt").input_ids[0]
    pre = runner(ids)
    cache, tokens = runner.start_decode(pre), [int(pre.logits.argmax())]
    for _ in range(5):
        tokens.append(int(runner.decode(cache, tokens[-1]).argmax()))
    assert tokens == s["tokens"]
    sampled = [runner.generate(ids, 6, Sampling(0.8, 0.9, 3)).tokens for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_chat_with_the_program_alone_prefills_only_what_is_new(exported, tmp_path, capsys):
    from llmnpu_delegate.cli import main

    turns = tmp_path / "turns.jsonl"
    turns.write_text('{"role": "user", "content": "one two three"}\n{"role": "user", "content": "four"}\n')
    assert main(["chat", "--pte", str(exported[0]), "--turns", str(turns), "--max-new-tokens", "3", "--json"]) == 0
    one, two = json.loads(capsys.readouterr().out)["turns"]
    assert one["cached_tokens"] == 0 and two["cached_tokens"] == one["prompt_tokens"]
    assert two["prompt_tokens"] > one["prompt_tokens"] + len(one["tokens"]) - 1
    assert main(["chat", "--pte", str(exported[0]), "--chunk", "8", "--turns", str(turns)]) == 2
    assert "drop --chunk" in capsys.readouterr().err


def test_run_pte_refuses_bad_programs_and_prompts(exported, tmp_path, capsys):
    pte = _copy_program(exported[0], tmp_path)

    def refused(*argv, match):
        code, out, err = _cli(capsys, "run", "--pte", pte, *argv)
        assert code == 2 and match in err and len(err.strip().splitlines()) == 1, err

    refused("--prompt", "x " * 200, match="more than the context of 128")
    refused("--prompt", "a b c", "--max-new-tokens", 127, match="past the program's context of 128")
    refused("--prompt", "a b c", "--model", "smollm2-135m", match="drop --model")
    shutil.rmtree(tmp_path / "tiny.tokenizer")
    refused("--prompt", "a b c", match="tokenizer folder tiny.tokenizer is missing")
    meta = json.loads(sidecar_path(pte).read_text())
    name, lin = next(iter(meta["shadow"]["linears"].items()))
    moved = {**meta, "shadow": {**meta["shadow"], "linears": {**meta["shadow"]["linears"],
                                                                name: {**lin, "rows_offset": pte.stat().st_size}}}}
    sidecar_path(pte).write_text(json.dumps({**moved, "sidecar_sha256": sidecar_digest(moved)}))
    refused("--prompt", "a b c", match=f"cold rows of {name} lie outside")
    sidecar_path(pte).write_text(json.dumps({**meta, "version": 1}))
    refused("--prompt", "a b c", match="another version of llmnpu export")
    runner = PteRunner(exported[0])
    cache = runner.start_decode(runner(torch.zeros(128, dtype=torch.long)))
    with pytest.raises(LlmNpuError, match="decode past the program's context of 128"):
        runner.decode(cache, 1)


# --------------------------------------------------------------------------- damaged sidecars (fuzzed)
def _program_copy(out, folder):
    """The .pte and everything beside it, copied into ``folder``; the copy's sidecar path."""
    import shutil as sh

    sh.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for f in out.parent.iterdir():
        (sh.copytree if f.is_dir() else sh.copy)(f, folder / f.name)
    return folder / out.name, sidecar_path(folder / out.name)


def _native_check(pte, *extra, binary=None) -> tuple[int, list[str], str]:
    """The native runner reading ``pte``'s sidecar alone (--dry-run): exit code, its error lines, stderr."""
    from test_native import _error_lines, _runner

    r = _runner("--pte", pte, "--dry-run", "--prompt-len", 40, *extra, binary=binary, timeout=120)
    return r.returncode, _error_lines(r.stderr), r.stderr


def _asan_runner():
    from test_native import ASAN_BUILD

    assert ASAN_BUILD.is_file(), "build it with `make runner/build-asan/llmnpu-runner` (make test does)"
    return ASAN_BUILD


@settings(max_examples=20, deadline=None, suppress_health_check=list(HealthCheck))
@given(how=BYTES)
@example(how=("flip", 0.5, 41))      # found by CI: a space at the middle became a tab
def test_damaged_sidecar_is_a_one_line_error(exported, tmp_path, how):
    """Both runners: any damage to the sidecar's bytes (its checksum catches what still parses) is
    refused in one line that names the file and the fix; the native one under AddressSanitizer and
    UndefinedBehaviorSanitizer, so a read past a buffer would show. The checksum is over the content,
    so damage that leaves the same content (a space turned into a tab between tokens) is no damage:
    both runners then load the program."""
    pte, side = _program_copy(exported[0], tmp_path / "program")
    good = side.read_bytes()
    side.write_bytes(damage_bytes(good, how))
    try:
        harmless = json.loads(side.read_bytes()) == json.loads(good)
    except ValueError:
        harmless = False
    if harmless:
        PteRunner(pte)
        assert _native_check(pte, binary=_asan_runner())[0] == 0
        return
    with pytest.raises(LlmNpuError) as e:
        PteRunner(pte)
    assert "\n" not in str(e.value) and side.name in str(e.value) and "export" in str(e.value), str(e.value)
    code, errors, stderr = _native_check(pte, binary=_asan_runner())
    assert code == 2 and len(errors) == 1 and side.name in errors[0] and "export" in errors[0], stderr[-1500:]


def test_the_native_runner_checks_what_the_python_runner_checks(exported, tmp_path):
    """The sidecar's checksum, its task table against the data flow (a dependency left out would be a
    race in the C++ schedule), and with --verify the .pte's SHA-256: refused by the native runner with
    the Python runner's reason."""

    pte, side = _program_copy(exported[0], tmp_path / "program")
    meta = json.loads(side.read_text())
    assert _native_check(pte)[0] == 0
    # The checksum is over Python's serialisation, which the C++ side must reproduce byte for byte:
    # floats of every kind (random bit patterns, float32 values, ties in the shortest digits, the
    # notation's edges) and strings Python escapes, in a key the runners ignore.
    rng = random.Random(0)
    floats = [0.0, -0.0, 1e-4, 1e-5, 9.999999999999999e-5, 1e15, 1e16, 9999999999999998.0, 5e-324,
              1.7976931348623157e308, 0.1, 2.0, 0.074970245361328125]
    floats += [struct.unpack("d", struct.pack("Q", rng.getrandbits(64)))[0] for _ in range(3000)]
    floats += [struct.unpack("f", struct.pack("I", rng.getrandbits(32)))[0] for _ in range(3000)]
    extra = dict(meta, extra={"floats": [x for x in floats if math.isfinite(x)], "text": "caf\u00e9 \U0001F600 \t\n\x01\x7f\"\\/"})
    extra["sidecar_sha256"] = sidecar_digest(extra)
    side.write_text(json.dumps(extra))
    code, _, stderr = _native_check(pte)
    assert code == 0, stderr

    def dropped_dependency(m):
        j = next(j for j, deps in enumerate(m["tasks"]["after"]) if deps)
        m["tasks"]["after"][j] = m["tasks"]["after"][j][1:]

    def swapped_processor(m):
        m["tasks"]["processors"][0] = {"npu": "cpu", "cpu": "npu"}[m["tasks"]["processors"][0]]

    def unneeded_step(m):
        m["tasks"]["needed_final"] = m["tasks"]["needed_final"][1:]

    def rescaled(m):
        m["linears"][next(iter(m["linears"]))]["act_scale"] *= 1.001

    cases = [(dropped_dependency, True, "tasks are not the data flow"), (swapped_processor, True, "processors"),
             (unneeded_step, True, "leaves out a step"), (rescaled, False, "checksum fails")]
    for corrupt, refit, reason in cases:
        bad = json.loads(json.dumps(meta))
        corrupt(bad)
        if refit:       # a buggy exporter: the checksum fits the wrong table
            bad["sidecar_sha256"] = sidecar_digest(bad)
        side.write_text(json.dumps(bad))
        with pytest.raises(LlmNpuError, match=reason):
            PteRunner(pte)
        code, errors, stderr = _native_check(pte)
        assert code == 2 and len(errors) == 1 and reason in errors[0], (corrupt.__name__, stderr)
    side.write_text(json.dumps(meta))
    # a .pte of the right size with one byte changed: only its digest tells
    data = bytearray(pte.read_bytes())
    data[len(data) // 2] ^= 1
    pte.write_bytes(bytes(data))
    with pytest.raises(LlmNpuError, match="another"):
        PteRunner(pte)
    assert _native_check(pte)[0] == 0                      # the size alone is checked by default
    code, _, stderr = _native_check(pte, "--verify")
    assert code == 2 and "SHA-256 differs" in stderr and stderr.count("\n") == 1, stderr


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_malformed_sidecar_is_refused_or_runs_the_same(exported, tmp_path, data):
    """A key deleted or a value of another type, with the checksum made to fit (a buggy or foreign
    exporter): the Python runner refuses in one line or gives the same logits; the native runner
    (--dry-run reads the whole sidecar), under AddressSanitizer and UndefinedBehaviorSanitizer, exits 0,
    or 2 with one line, and never crashes."""

    pte, side = _program_copy(exported[0], tmp_path / "program")
    meta = json.loads(side.read_text())
    path, value, delete = data.draw(structure(meta, json_only=True))
    bad = mutated(meta, path, value, delete)
    bad["sidecar_sha256"] = sidecar_digest(bad)
    side.write_text(json.dumps(bad))
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(0))
    try:
        got = PteRunner(pte)(ids).logits
    except LlmNpuError as e:
        assert "\n" not in str(e) and "export" in str(e), str(e)
    else:
        assert torch.equal(got, PteRunner(exported[0])(ids).logits)
    code, errors, stderr = _native_check(pte, binary=_asan_runner())
    assert code == 0 or (code == 2 and len(errors) == 1), (path, code, stderr[-1500:])


def test_the_arm64_runner_gives_the_x86_tokens_on_the_tiny_program(exported, tmp_path):
    """The aarch64 build under qemu-aarch64 (tests/test_native.py) on the tiny model's program (float
    decode): the x86 build's greedy tokens and cold-row count, logits within 4 float32 steps."""
    import numpy as np
    from test_native import arm64_and_x86

    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(4)).tolist()
    # the prompt's row (the decode's float steps that follow drift by a few more float32 steps on Arm)
    arm, x86, got, want = arm64_and_x86(exported[0], ids, 8, tmp_path)
    assert arm.tokens == x86.tokens and arm.summary["cold_rows"] == x86.summary["cold_rows"]
    assert np.abs(got - want).max() <= 4 * np.spacing(np.abs(want).max()), np.abs(got - want).max()


def test_rows_of_an_unknown_float_type_are_refused_by_both_runners(exported, tmp_path):
    """A rows file the runners cannot read (its type is not float32, float16 or int8) is refused in one line
    before any prompt, not read as the wrong floats."""

    pte, side = _program_copy(exported[0], tmp_path / "program")
    meta = json.loads(side.read_text())
    assert meta["shadow"]["rows_dtype"] == "int8"
    meta["shadow"]["rows_dtype"] = "bfloat16"
    meta["sidecar_sha256"] = sidecar_digest(meta)
    side.write_text(json.dumps(meta))
    with pytest.raises(LlmNpuError, match="rows_dtype is 'bfloat16'"):
        PteRunner(pte)
    code, errors, stderr = _native_check(pte)
    assert code == 2 and len(errors) == 1 and "bfloat16" in errors[0], stderr


@pytest.mark.parametrize("static", [-1, {"x": 0.1}, {"-3": 0.1}, [0.1]])
def test_native_runner_refuses_a_garbled_profile_in_one_line(exported, tmp_path, static):
    """Found by the property test above: a profile whose step table is not a table of step numbers
    once escaped as a bare `stoi` from the native runner (exit 1)."""

    pte, side = _program_copy(exported[0], tmp_path / "program")
    meta = json.loads(side.read_text())
    assert meta["profile"] is not None, "the fixture should carry a profile for this test to mean anything"
    meta["profile"]["static"] = static
    meta["sidecar_sha256"] = sidecar_digest(meta)
    side.write_text(json.dumps(meta))
    code, errors, stderr = _native_check(pte)
    assert code == 2 and len(errors) == 1 and "profile" in errors[0], stderr
