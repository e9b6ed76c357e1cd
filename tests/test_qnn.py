"""The QNN delegate on this host: SDK folder and shim, our encodings, HTP simulator parity with cpu-int8."""
import json
import shutil
import subprocess

import numpy as np
import pytest
import torch
from conftest import missing, run_python

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.quantize.sqnr import sqnr_db
from llmnpu_delegate.qnn import sdk as qsdk

pytestmark = pytest.mark.skipif(qsdk.importlib.util.find_spec("onnxruntime_qnn") is None,
                                reason=missing("the qnn extra (pip install -e '.[qnn]')"))


def test_sdk_folder_and_shim_from_a_clean_cache(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    sdk = qsdk.prepare_sdk(tmp_path / "sdk")
    lib = sdk.lib
    assert sdk.provided_by == "onnxruntime-qnn" and sdk.version.startswith("2.")
    assert (lib / "libQnnHtp_real.so").is_symlink() and (lib / "libQnnSystem.so").is_symlink()
    shim = lib / "libQnnHtp.so"
    assert not shim.is_symlink()
    dyn = subprocess.run(["readelf", "-d", str(shim)], capture_output=True, text=True).stdout
    assert "SONAME" in dyn and "[libQnnHtp.so]" in dyn and "NODELETE" in dyn
    syms = subprocess.run(["nm", "-D", "--defined-only", str(shim)], capture_output=True, text=True).stdout
    assert "QnnInterface_getProviders" in syms
    again = qsdk.prepare_sdk(tmp_path / "sdk")           # built once, then reused
    assert again == sdk and shim.stat().st_mtime == (again.lib / "libQnnHtp.so").stat().st_mtime


def test_errors_name_what_to_install(tmp_path, monkeypatch):
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    real = qsdk.importlib.util.find_spec
    monkeypatch.setattr(qsdk.importlib.util, "find_spec", lambda n: None if n == "onnxruntime_qnn" else real(n))
    with pytest.raises(LlmNpuError, match=r"pip install 'llmnpu_delegate\[qnn\]'"):
        qsdk.prepare_sdk(tmp_path / "a")
    monkeypatch.setattr(qsdk.importlib.util, "find_spec", real)
    monkeypatch.setattr(qsdk.shutil, "which", lambda name: None)
    with pytest.raises(LlmNpuError, match="install gcc"):
        qsdk.prepare_sdk(tmp_path / "b")
    assert not (tmp_path / "b").exists()                  # nothing half-built left behind
    monkeypatch.setattr(qsdk.shutil, "which", shutil.which)
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "nowhere"))
    with pytest.raises(LlmNpuError, match="QNN_SDK_ROOT"):
        qsdk.prepare_sdk()


def test_user_sdk_root_wins(tmp_path, monkeypatch):
    lib = tmp_path / "sdk" / qsdk.LIB_SUBDIR
    lib.mkdir(parents=True)
    (lib / "libQnnHtp.so").write_bytes(b"")
    monkeypatch.setenv("QNN_SDK_ROOT", str(tmp_path / "sdk"))
    assert qsdk.prepare_sdk().provided_by == "QNN_SDK_ROOT"


def test_unknown_soc_is_refused_with_the_list():
    from llmnpu_delegate.backends.qnn import check_soc

    check_soc("SM8650")
    with pytest.raises(LlmNpuError, match="unknown SoC 'SM9999'.*SM8550.*SM8650"):
        check_soc("SM9999")


def test_export_command_refuses_an_unknown_soc_before_loading_the_model(tmp_path, capsys):
    from llmnpu_delegate.cli import main

    assert main(["export", "--model", "no-such-model", "--soc", "SM9999", "--out", str(tmp_path / "m.pte")]) == 2
    err = capsys.readouterr().err
    assert "unknown SoC 'SM9999'" in err and "SM8650" in err
    assert not any(tmp_path.iterdir())


def test_an_automatic_placement_is_a_phones_choice_refused_for_cpu_int8(tmp_path, capsys):
    from llmnpu_delegate.cli import main

    out = tmp_path / "m.pte"
    assert main(["export", "--model", "no-such-model", "--backend", "cpu-int8", "--placement", "auto",
                 "--out", str(out)]) == 2
    assert "--placement auto chooses by a phone's predicted prefill, for --backend qnn" in capsys.readouterr().err
    assert not any(tmp_path.iterdir())


@pytest.fixture(scope="module")
def engine(shared_tiny_engine):
    return shared_tiny_engine


@pytest.fixture(scope="module")
def htp_fine(engine, tmp_path_factory):
    """The tiny model's HTP program with 8-bit outputs, every one with a second encoding, and the INT8
    head: one export read by the two tests of second encodings below."""
    from conftest import export_8bit

    return export_8bit(engine, tmp_path_factory.mktemp("htp") / "tiny-htp.pte", target="qnn", soc="SM8650")


def test_encodings_are_ours(engine):
    """The lowered graph's input and weight encodings are the plan's scales and our INT8 weights."""
    from llmnpu_delegate.lower.npu_subgraphs import quantized_region, region_spec
    from llmnpu_delegate.quantize.linear import quantize_weight

    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    spec = region_spec("m", names, engine.plans)
    linears = [engine.backend.linear(n) for n in names]
    graph, _ = quantized_region(spec, linears, engine.plans, "channel", torch.randn(64, 64), "qnn", rows_per_call=32)
    nodes = list(graph.graph.nodes)
    inputs = [n for n in nodes if "quantize_per_tensor" in str(n.target) and n.args[0].op == "placeholder"]
    assert sorted(float(n.args[1]) for n in inputs) == pytest.approx(sorted(spec.scales), rel=1e-6)
    assert all(n.args[2] == 128 for n in inputs)
    weights = [n for n in nodes if "dequantize_per_channel" in str(n.target)]
    assert len(weights) == 3
    for lin, node in zip(linears, weights):
        w_q, w_scale = quantize_weight(lin.weight, "channel")
        assert torch.equal(getattr(graph, node.args[0].target), w_q)
        assert torch.allclose(getattr(graph, node.args[1].target).float(), w_scale, rtol=1e-6, atol=0)


def test_the_qnn_quantizer_leaves_onednn_as_it_was():
    """ExecuTorch's Qualcomm quantizer turns oneDNN off process-wide on AMD hosts; ours puts it back
    (the engine's bf16 attention runs on oneDNN's brgemm). On another vendor's CPU nothing changes
    either way."""
    from llmnpu_delegate import backends
    from llmnpu_delegate.lower.encodings import LlmNpuQuantizer

    assert torch.backends.mkldnn.enabled
    backends.get("qnn").quantizer(LlmNpuQuantizer({}))
    assert torch.backends.mkldnn.enabled


def test_the_runtimes_kernels_register_before_the_qualcomm_packages():
    """ExecuTorch keeps the first kernel registered for an op; the Qualcomm package loads portable
    ones (``executorch.kernels.quantized``). Built first in a process, its quantizer left a float
    LM head on the portable loop in every program that process ran (other bits than the native
    runner's: the bit-for-bit tests below failed after this file's quantizer tests)."""
    script = ("import sys\n"
              "from llmnpu_delegate import backends\n"
              "from llmnpu_delegate.lower.encodings import LlmNpuQuantizer\n"
              "backends.get('qnn').quantizer(LlmNpuQuantizer({}))\n"
              "names = list(sys.modules)\n"
              "print(names.index('executorch.extension.pybindings.portable_lib') < "
              "names.index('executorch.kernels.quantized'))\n")
    assert run_python(script).stdout.strip().splitlines()[-1] == "True"


def test_qnn_pte_on_the_simulator_matches_cpu_int8(engine, tmp_path):
    """`export --backend qnn` of the tiny model: every NPU method (an HTP context binary with our
    encodings) on Qualcomm's simulator against the engine, then a whole prefill from the .pte alone."""
    from conftest import TINY_CHUNK as CHUNK

    qsdk.activate()
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import flatbuffer_to_option

    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.program_writer import delegate_specs
    from llmnpu_delegate.lower.pte import export_pte
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import validate_pte

    ids = torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(2))
    # output encodings observed on the very rows compared: rounding alone is left. The float decode
    # keeps the float head, as the engine's prefill has it: the NPU methods are what is compared here
    # (with the INT8 decode's INT8 head the last check reads 14.8 vs 18.8 dB on this random model; that
    # head is tested against its own arithmetic in test_embedding_head.py)
    summary = export_pte(engine, tmp_path / "tiny.pte", ids,
                         ExportConfig(target="qnn", soc="SM8650", context=4 * CHUNK, decode="fp32"),
                         progress=False)
    assert summary["npu_methods"] >= 8 and summary["pte_bytes"] > 0 and summary["soc"] == "SM8650"
    # one HTP context per decoder block, holding the graphs of all its NPU methods: the validation
    # below then runs each method's own graph out of the shared context
    table = json.loads((tmp_path / "tiny.json").read_text())["subgraphs"]
    blocks = {e["layer"] for e in table if e["kind"] == "npu"}
    assert summary["npu_contexts"] == len(blocks) < summary["npu_methods"], summary
    # its contexts may share one spill-fill buffer (each asks for the same size: here none spills)
    htp = [flatbuffer_to_option(s.value).backend_options.htp_options
           for _, backend, specs in delegate_specs(tmp_path / "tiny.pte") if backend == "QnnBackend" for s in specs]
    assert len(htp) >= 8 and all(o.use_multi_contexts for o in htp) and len({o.max_sf_buf_size for o in htp}) == 1
    runner = PteRunner(tmp_path / "tiny.pte")
    report = validate_pte(tmp_path / "tiny.pte", engine, ids, runner=runner)
    worst = min(r["within_2_steps"] for r in report["linears"])
    assert worst >= 0.99, report["linears"]
    # where nothing saturates: the output rounding only (inputs handed over on the activation grid)
    assert max(r["max_steps"] for r in report["linears"]) <= 1
    assert min(r["sqnr_db"] for r in report["linears"]) > 25
    assert report["prefill"]["chunks"] == 2 and report["prefill"]["logits_sqnr_db"] > 18
    assert report["prefill"]["kv_sqnr_db_min"] > 18
    vs = report["prefill"]["logits_sqnr_db_vs_fp32"]       # the .pte strays no further from float than we do
    assert vs["pte"] > vs["engine"] - 3, vs
    # the same program generates: prefill on the simulator, decode (XNNPACK) from its K/V
    out = runner.generate(ids[:40], 3)
    assert len(out.tokens) == 3 and out.chunks == 2
    assert out.tokens[0] == int(runner(ids[:40]).logits.argmax())
    # the native runner on the same program: NPU methods on the simulator through its own process;
    # no cold rows are hit here, so nothing sums in another order. Both load the same ExecuTorch and
    # QNN shared libraries (ldd), and on an AMX-class Xeon the logits are bit-identical (with 1 or 2
    # XNNPACK threads in the Python runner); on a Zen 4 they differed by up to 2.4e-7 (logits up to
    # ~10), at f5c11ce too, a CPU-dependent rounding not traced further: 1e-6 (one ULP at 10) is allowed
    from llmnpu_delegate.runtime.native import run_native

    native = run_native(tmp_path / "tiny.pte", ids[:40].tolist(), runner.meta, 3, logits_out=tmp_path / "l.bin")
    assert native.tokens == out.tokens and native.summary["cold_rows"] == out.cold_rows == 0
    ref = runner(ids[:40]).logits.numpy()
    logits = np.fromfile(tmp_path / "l.bin", dtype="<f4")[:ref.size]      # the prompt's row; decode's follow
    np.testing.assert_allclose(logits, ref, rtol=0, atol=1e-6)


def test_methods_lowered_together_share_one_context_and_each_runs_its_own_graph(tmp_path):
    """Two NPU methods lowered in one call: the program stores one HTP context for both, the runtime
    loads it once (the second method takes its cached handle), and each method runs its own graph on
    the simulator, within 2 output steps of its PyTorch reference, as export's validation asks of a
    linear (the HTP rounds the ReLU's input and output on its own; measured: 2.0 steps at most). The
    two graphs differ in shape and function, so a method that ran the other's graph fails here."""
    qsdk.activate()
    from executorch.runtime import Runtime

    from llmnpu_delegate.format.npu_io import RegionSpec
    from llmnpu_delegate.lower.npu_subgraphs import Converted, lower_converted, output_encodings
    from llmnpu_delegate.lower.program_writer import ProgramWriter, emit_method
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from llmnpu_delegate.backends.qnn import qnn_quantizer

    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(3))

    def converted(module):          # ExecuTorch's own 8-bit annotation: what is shared is under test
        prepared = prepare_pt2e(torch.export.export(module.eval(), (x,), strict=False).module(), qnn_quantizer())
        prepared(x)
        return convert_pt2e(prepared)
    torch.manual_seed(1)
    graphs = {"npu_a": converted(torch.nn.Linear(64, 24)),
              "npu_b": converted(torch.nn.Sequential(torch.nn.Linear(64, 40), torch.nn.ReLU()))}
    edge = lower_converted([Converted(RegionSpec(m, [], [], []), g, (x,)) for m, g in graphs.items()], "qnn", "SM8650")
    writer = ProgramWriter()
    for m in graphs:
        writer.add(emit_method(m, edge.exported_program(m)))
    assert writer.payloads(graphs) == 1
    writer.write(tmp_path / "two.pte")
    program = Runtime.get().load_program(tmp_path / "two.pte")
    for m in ("npu_b", "npu_a"):
        want = graphs[m](x)
        got = program.load_method(m).execute((x,))[0]
        (step,) = [e.scale for e in output_encodings(graphs[m])]
        assert got.shape == want.shape and float((got - want).abs().max()) <= 2.01 * step, m


def test_a_programs_contexts_reserve_one_spill_fill_buffer_the_size_of_the_largest():
    """Each HTP context, lowered, records the spill-fill buffer it needs; in the program all of them
    then ask for the largest, which the runtime reserves once for every context (ExecuTorch's
    multi-contexts), and the XNNPACK calls beside them are left as they were."""
    qsdk.activate()
    from executorch.backends.qualcomm.serialization.qc_schema_serialize import (
        flatbuffer_to_option,
        option_to_flatbuffer,
    )
    from executorch.backends.qualcomm.utils.utils import (
        generate_htp_compiler_spec,
        generate_qnn_executorch_compiler_spec,
    )
    from executorch.exir.schema import CompileSpec

    from llmnpu_delegate import backends
    from llmnpu_delegate.backends.qnn import BACKEND_ID, SPEC_KEY, check_soc

    (spec,) = generate_qnn_executorch_compiler_spec(
        soc_model=check_soc("SM8650"), backend_options=generate_htp_compiler_spec(use_fp16=False, use_multi_contexts=True))
    assert spec.key == SPEC_KEY

    def qnn_call(size):
        option = flatbuffer_to_option(spec.value)
        option.backend_options.htp_options.max_sf_buf_size = size
        return BACKEND_ID, [CompileSpec(SPEC_KEY, option_to_flatbuffer(option))]

    delegates = [qnn_call(0), qnn_call(19 << 20), ("XnnpackBackend", [CompileSpec("x", b"kept")]), qnn_call(3 << 20)]
    backends.get("qnn").join(delegates)
    htp = [flatbuffer_to_option(s.value).backend_options.htp_options for b, specs in delegates if b == BACKEND_ID
           for s in specs]
    assert [o.max_sf_buf_size for o in htp] == [19 << 20] * 3 and all(o.use_multi_contexts for o in htp)
    assert delegates[2][1][0].value == b"kept"


def test_when_the_htp_cannot_hold_every_context_the_npu_methods_load_per_call(htp_fine, monkeypatch, caplog):
    """A program whose contexts do not fit in the HTP's memory together (a chunk-1,024 one on the
    simulator) still runs: the runner then loads the NPU methods when they are called, from a program
    of their context's own, and computes bit for bit what the resident methods compute. The fake HTP
    below holds one context fewer than the program has (one per block) in each program, as the runtime
    frees them only with their program (measured on the simulator: 15 of a chunk-1,024 program's 30
    block contexts load into one program)."""
    from executorch.runtime import Program

    from llmnpu_delegate.lower.program_writer import method_payloads
    from llmnpu_delegate.runtime import pte_runner

    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5))
    resident = pte_runner.PteRunner(htp_fine)
    want = resident(ids)
    assert not resident.npu_on_call
    del resident
    npu = {e["method"] for e in json.loads(htp_fine.with_suffix(".json").read_text())["subgraphs"]
           if e["processor"] == "npu"}
    load, held, context_of, programs = Program.load_method, {}, method_payloads(htp_fine), []
    contexts = {context_of[n] for n in npu}
    room = len(contexts) - 1

    def small_htp(self, name):
        if name in npu:
            programs.append(self)           # kept, so that no later program takes its id
            held.setdefault(id(self), set()).add(context_of[name])
            if len(held[id(self)]) > room:
                raise RuntimeError(f"Failed to load method {name}, error: 0x:1")
        return load(self, name)
    monkeypatch.setattr(Program, "load_method", small_htp)
    with caplog.at_level("WARNING", logger=pte_runner.__name__):
        runner = pte_runner.PteRunner(htp_fine)
    assert runner.npu_on_call and 2 <= len(contexts) < len(npu)
    assert "does not hold all of" in caplog.text and "load when called" in caplog.text
    got = runner(ids)
    # each program the runner loaded on call held the methods of one context
    assert sum(len(c) > 1 for c in held.values()) == 1, held     # the resident attempt only
    assert torch.equal(got.logits, want.logits)
    assert all(torch.equal(a, b) for a, b in zip(got.past_k + got.past_v, want.past_k + want.past_v))


def test_the_native_runner_loads_the_npu_methods_per_call_too_when_the_htp_cannot_hold_them(htp_fine, monkeypatch,
                                                                                             tmp_path):
    """The C++ runner's same fallback: its stand-in for a small HTP (an environment variable for tests)
    fails the first NPU method of the second block, as the simulator does when its memory is full; the
    runner then loads the NPU methods a block at a time when called, and gives the resident Python
    runner's tokens and logits (to the 1e-6 the two runners keep on this program:
    test_qnn_pte_on_the_simulator_matches_cpu_int8)."""
    from llmnpu_delegate.runtime.native import run_native
    from llmnpu_delegate.runtime.pte_runner import PteRunner

    runner = PteRunner(htp_fine)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5))
    want = runner.generate(ids, 3)
    ref = runner(ids).logits.numpy().reshape(-1)
    del runner
    resident = run_native(htp_fine, ids.tolist(), load_sidecar_of(htp_fine), 3)
    monkeypatch.setenv("LLMNPU_RUNNER_TEST_NPU_BLOCKS", "1")
    got = run_native(htp_fine, ids.tolist(), load_sidecar_of(htp_fine), 3, logits_out=tmp_path / "l.bin")
    assert not resident.summary["npu_on_call"] and got.summary["npu_on_call"]
    assert got.tokens == want.tokens
    np.testing.assert_allclose(np.fromfile(tmp_path / "l.bin", dtype="<f4")[:ref.size], ref, rtol=0, atol=1e-6)


def load_sidecar_of(pte):
    from llmnpu_delegate.format.sidecar import load_sidecar

    return load_sidecar(pte)


def test_the_native_runner_says_in_one_line_what_a_qnn_method_it_cannot_load_needs(htp_fine):
    """Without QNN's libraries in the loader's path (a user who starts the binary by hand) the first NPU
    method fails to load inside ExecuTorch's delegate: the runner's one line names the method and both
    things a QNN program needs, the libraries and the HTP's memory for all its contexts."""
    from llmnpu_delegate.format.sidecar import load_sidecar
    from llmnpu_delegate.runtime.native import find_runner, run_native

    meta = load_sidecar(htp_fine)
    # run_native gives the binary QNN's libraries; `env -u` takes them away again
    with pytest.raises(LlmNpuError) as err:
        run_native(htp_fine, [1, 2, 3], meta, 1, binary=["env", "-u", "LD_LIBRARY_PATH", str(find_runner())])
    message = str(err.value)
    assert "\n" not in message and message.startswith("native runner: cannot load method npu_"), message
    assert "LD_LIBRARY_PATH" in message and "HTP contexts to fit" in message, message


def test_second_encodings_in_their_qnn_form_bring_the_merged_outputs_closer(engine, htp_fine, tmp_path):
    """The second, finer encodings (uint8 with a zero point in the program, as QNN takes them) on
    Qualcomm's simulator:
    forced on every NPU output of the tiny model, each merged output is at least as close to the
    engine's float output as the one coarse encoding's, and closer where the fine range is narrower
    than the coarse one; a program without them is the control (the two differ in their decode head
    too, which the NPU methods compared here do not read)."""
    from conftest import TINY_CHUNK as CHUNK

    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.pte import export_pte
    from llmnpu_delegate.runtime.validate import validate_pte

    ids = torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(2))   # export_8bit's
    coarse = tmp_path / "coarse.pte"
    export_pte(engine, coarse, ids, ExportConfig(target="qnn", soc="SM8650", context=4 * CHUNK, decode="fp32",
                                                 fine=False), progress=False)
    reports = {}
    for name, pte in (("coarse", coarse), ("fine", htp_fine)):
        meta = json.loads(pte.with_suffix(".json").read_text())
        reports[name] = ({r["linear"]: r for r in validate_pte(pte, engine, ids)["linears"]}, meta)
    coarse, fine = reports["coarse"][0], reports["fine"][0]
    fine_meta = reports["fine"][1]["linears"]
    assert all(r["fine_outputs"] == 0 for r in coarse.values())
    assert all(fine[n]["fine_outputs"] >= 1 for n in fine) and fine_meta
    for n in fine:         # 8-bit, and a narrower range than the output's one encoding
        coarse_range = fine_meta[n]["output"]["range"]
        for f in fine_meta[n]["fine_outputs"]:
            low, high = f["range"]
            assert f["bits"] == 8 and 0 < f["scale"] and coarse_range[0] <= low < high <= coarse_range[1], f
    gains = {n: fine[n]["sqnr_db"] - coarse[n]["sqnr_db"] for n in fine}
    assert min(gains.values()) > -0.5, gains          # never worse beyond rounding of the measure
    assert sorted(gains.values())[len(gains) // 2] > 1.0, gains     # and better for most outputs


def test_the_qnn_mode_computes_what_the_htp_program_computes(engine, htp_fine):
    """The ``qnn`` evaluation mode against an HTP program on Qualcomm's simulator (the tiny model, every
    output with a second encoding, INT8 head). HTP requantizes an output by its own arithmetic: where
    the exact product lies within a few hundredths of a step of halfway between two codes, it may
    take the other one (measured: 2-3 % of each linear's elements, all within 0.06 of halfway, as
    often up as down). So each method's outputs are within a code of the mode's, the codes apart are
    few and next to halfway, and the prompt's logits are closer to the program's than the engine's
    (float outputs) are by what those codes leave: their noise is about a third of the 8-bit
    rounding's (a 2.5 % share of 1-step errors against step^2/12), measured 35.0 dB against 25.2."""
    from test_program_numerics import method_gaps, tiny_lm

    from llmnpu_delegate.evaluate import program_model
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import sqnr_db

    pte = htp_fine
    model, changed = program_model(tiny_lm(), pte, engine.calibration, progress=False)
    assert changed["fine_outputs"] >= changed["linears"] > 0
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5))
    gaps = method_gaps(engine, pte, model, ids)
    print("HTP against the qnn mode, per linear:", gaps)
    assert max(g["steps"] for g in gaps.values()) <= 1 + 1e-4, gaps      # a code, to float rounding
    assert max(g["share"] for g in gaps.values()) < 0.05, gaps
    assert max(g["tie"] for g in gaps.values()) < 0.1, gaps
    want = PteRunner(pte)(ids).logits.reshape(-1)
    with torch.inference_mode():
        ours = model(input_ids=ids[None], use_cache=False).logits[0, -1].float()
    ours_db, engine_db = sqnr_db(ours, want), sqnr_db(engine(ids).logits.reshape(-1), want)
    print(f"logits against the HTP program's: qnn mode {ours_db:.1f} dB, engine {engine_db:.1f} dB")
    assert ours_db > engine_db + 5, (ours_db, engine_db)


@pytest.mark.slow
def test_export_and_validate_commands_on_the_embedded_model(tmp_path, capsys):
    """The issue's commands on two blocks of the embedded model: QNN methods for SM8650 with the
    block norms, RoPE and attention in their HTP graphs (the automatic choice is tested in
    test_placement.py: here it would partition the whole model three times), then `llmnpu
    validate`, whose exit status says the .pte predicts the engine's next token."""
    import re

    from llmnpu_delegate.cli import main

    out = tmp_path / "smollm2-2.pte"
    assert main(["export", "--backend", "qnn", "--soc", "SM8650", "--chunk", "64", "--blocks", "2",
                 "--placement", "attention-half", "--out", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"placement attention-half: 6 of the \d+ NPU methods hold more than linears, one HTP graph "
                     r"each: 4 a block norm at 16 bits with the 8-bit linears it feeds; 2 RoPE and attention", text), text
    assert out.is_file() and out.with_suffix(".json").is_file()
    assert main(["validate", "--pte", str(out), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "same next token" in text and "HTP simulator" in text


def test_a_timeline_draws_after_the_sdk_is_activated(tmp_path):
    """activate() loads onnxruntime-qnn's bundled LLVM libunwind/libc++abi; loaded globally they became
    the personality routine of every C++ extension loaded later, and drawing a timeline (matplotlib's
    ft2font) segfaulted. A fresh process: the libraries load once per process."""
    script = ("import sys\n"
              "from llmnpu_delegate.qnn import sdk\n"
              "from llmnpu_delegate.runtime.schedule import Record, RunStats\n"
              "from llmnpu_delegate.runtime.trace import write_timeline\n"
              "sdk.activate()\n"
              "stats = RunStats(records=[Record(0, 0, 0, 'npu', 0.0, 1e-3), Record(1, 0, 1, 'cpu', 1e-3, 2e-3)],"
              " wall_s=2e-3, policy='ooo')\n"
              "write_timeline(stats, __import__('pathlib').Path(sys.argv[1]), 'after QNN')\n")
    out = tmp_path / "timeline.png"
    run_python(script, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------ attention as a QNN method
def _run_method(edge, method: str, inputs) -> torch.Tensor:
    from executorch.runtime import Runtime

    return Runtime.get().load_program(edge.to_executorch().buffer).load_method(method).execute(list(inputs))[0]


def test_attention_as_one_htp_graph_computes_the_references_encodings():
    """The chunk's attention against a fixed window (48 past keys, the chunk's 16, 64 empty slots)
    lowered to one HTP context binary, run on the simulator, against ``npu_attention``."""
    from llmnpu_delegate.kernels.attention import causal_mask, chunk_attention
    from llmnpu_delegate.kernels.npu_attention import AttentionEncodings, attention_ranges, npu_attention
    from llmnpu_delegate.lower.attention_method import graph_inputs, lower_attention, output_of, quantized_attention

    h, kvh, c, past, window, d = 4, 2, 16, 48, 128, 32
    scaling = d ** -0.5
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, h, c, d, generator=g) * 2
    k = torch.randn(1, kvh, window, d, generator=g) * 3
    v = torch.randn(1, kvh, window, d, generator=g)
    allowed = torch.zeros(c, window, dtype=torch.bool)
    allowed[:, :past + c] = causal_mask(c, past + c).reshape(c, -1)
    want_float = chunk_attention(q, k[:, :, :past + c], v[:, :, :past + c], allowed[:, :past + c], scaling, 0.0)
    enc = AttentionEncodings.of_ranges(attention_ranges(q, k, v, allowed, scaling, want_float), kv_bits=16)
    ref = npu_attention(q, k, v, allowed, scaling, enc)
    example = graph_inputs(q, k, v, allowed, scaling, enc)
    assert torch.backends.mkldnn.enabled
    edge = lower_attention("attention", enc, scaling, example, "SM8750")
    # ExecuTorch's QnnManager turns oneDNN off on an AMD host at each lowering; ours puts it back
    assert torch.backends.mkldnn.enabled
    (name,) = edge.methods
    calls = [n for n in edge.exported_program(name).graph.nodes if n.op == "call_function"]
    assert sum("executorch_call_delegate" in str(n.target) for n in calls) == 1
    got = output_of(_run_method(edge, name, example), h)
    # the converted graph (pt2e's own fake quantization of the same encodings) is the reference's
    # arithmetic, up to float32 rounding at a tie (measured: none off; 7 of 2,048 at 1 or 2 steps
    # before the grids had headroom)
    conv = output_of(quantized_attention(enc, scaling, example)(*example), h)
    off = ((conv - ref).abs() / enc.out.scale).round()
    assert off.max() <= 2 and (off > 0).float().mean() < 0.01
    # HTP's output is on the output's grid, near the reference: the scores land within 2 steps of
    # theirs (measured alone), but HTP's softmax is its own approximation (measured alone: up to 43
    # steps of 1/65535 from exact softmax rounded); through P V, measured: at most 27 steps of the
    # output's encoding, 1.9 on average, on this window (the simulator is deterministic)
    codes = got / enc.out.scale + enc.out.zero
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    steps = ((got - ref).abs() / enc.out.scale).round()
    assert steps.max() <= 40 and steps.mean() <= 4
    # ...which leaves it near float attention, if not as near as the reference (measured: 4.6e-4
    # and 1.7e-4 of the output's span; an 8-bit window, 1e-2)
    span = float(want_float.max() - want_float.min())
    err_htp, err_ref = (float((x - want_float).abs().max()) / span for x in (got, ref))
    assert err_htp < 4 * err_ref and err_htp < 1e-3
    # the mask holds: whatever the window's empty slots hold, no query reads them
    k2, v2 = k.clone(), v.clone()
    k2[:, :, past + c:], v2[:, :, past + c:] = 50.0, -50.0
    again = output_of(_run_method(edge, name, graph_inputs(q, k2, v2, allowed, scaling, enc)), h)
    assert torch.equal(again, got)
    with pytest.raises(LlmNpuError, match="16-bit K/V window, not 8-bit"):
        lower_attention("attention", AttentionEncodings.of_ranges(attention_ranges(q, k, v, allowed, scaling,
                                                                                   want_float), 8),
                        scaling, example, "SM8750")


# ------------------------------------------------------------------ a block norm as a QNN method
def test_a_block_norm_as_one_htp_graph_computes_the_references_encodings(smollm2):
    """The embedded model's widest norm (its input holds the residual stream's ~25,000 outliers) at
    the encodings calibrated on the shipped text, lowered to HTP's RmsNorm, run on the simulator
    on evaluation text, against ``npu_norm``."""
    from llmnpu_delegate.kernels.npu_norm import NormEncodings, npu_rms_norm
    from llmnpu_delegate.lower.norm_method import lower_norm, quantized_norm
    from llmnpu_delegate.prepare import norm_modules, norm_ranges_of
    from llmnpu_delegate.text import read_text, tokenize

    ranges = norm_ranges_of(smollm2, 256)
    key = max(ranges, key=lambda k: ranges[k]["x"][1] - ranges[k]["x"][0])
    module = norm_modules(smollm2.model)[key]
    assert ranges[key]["x"][1] - ranges[key]["x"][0] > 10_000        # the outliers are in the grid
    enc = NormEncodings.of_ranges(ranges[key], module.weight)
    seen = {}
    hook = module.register_forward_hook(lambda m, a, out: seen.update(x=a[0][0].float(), out=out[0].float()))
    with torch.inference_mode():
        smollm2.model(tokenize(smollm2, read_text(None, "eval"))[:128][None])
    hook.remove()
    x, want_float = seen["x"].clone(), seen["out"].clone()
    ref = npu_rms_norm(x, module.weight.detach(), module.variance_epsilon, enc)
    edge = lower_norm("norm", enc, module.weight, module.variance_epsilon, (x,), "SM8750")
    calls = [n for n in edge.exported_program("norm").graph.nodes if n.op == "call_function"]
    assert sum("executorch_call_delegate" in str(n.target) for n in calls) == 1
    got = _run_method(edge, "norm", (x,))
    # pt2e's own fake quantization of the graph is the reference's arithmetic
    conv = quantized_norm(enc, module.weight, module.variance_epsilon, (x,))(x).detach()
    assert float(((conv - ref).abs() / enc.out.scale).round().max()) <= 1
    # HTP's RmsNorm lands on the output's grid within one step of the reference (measured: at most
    # 1, 46 % of the values 1 off: HTP rounds its wider internal result once more)
    codes = got / enc.out.scale + enc.out.zero
    assert torch.allclose(codes, codes.round(), atol=1e-3)
    steps = ((got - ref).abs() / enc.out.scale).round()
    assert steps.max() <= 1
    # ...both near the float norm: the 16-bit input grid over the outliers' range is what costs
    # (measured on this norm, layer 12's input norm: both 34.0 dB from the float norm)
    assert sqnr_db(want_float, got) > sqnr_db(want_float, ref) - 1.0
    assert sqnr_db(want_float, ref) > 30


# ------------------------------------------------------------------ the norms placement as a QNN program
@pytest.fixture(scope="module")
def htp_norms(tmp_path_factory):
    """The tiny engine under ``norms`` with 70 % of its shadow paths (a region whose linears have none
    returns no normed rows; cold rows still get hit), and its HTP program."""
    return _tiny_htp_program("norms", tmp_path_factory.mktemp("htp-norms") / "tiny.pte")


def _tiny_htp_program(placement: str, out, spec: str = "random:tiny-llama", pruning_rate: float = 0.3,
                      residual_bits: int = 8):
    """(the tiny engine (``spec``) under ``placement`` with ``1 - pruning_rate`` of its shadow paths,
    its SM8650 program at ``out`` with a 4-chunk context and ``residual_bits``, the export's summary)."""
    from conftest import TINY_CHUNK, tiny_engine

    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.pte import export_pte

    engine = tiny_engine(placement=placement, pruning_rate=pruning_rate, spec=spec)
    ids = torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(2))
    summary = export_pte(engine, out, ids, ExportConfig(target="qnn", soc="SM8650", context=4 * TINY_CHUNK,
                                                        decode="fp32", residual_bits=residual_bits),
                         model={"spec": spec}, progress=False)
    return engine, out, summary


def _region_io(engine, ids, regions) -> list:
    """(step, inputs, outputs) of every call the engine makes of the steps ``regions`` for ``ids``."""
    steps = engine.program.steps
    seen, original = [], {i: steps[i].fn for i in regions}

    def recorded(i):
        def record(*args):
            inputs = [a.clone() for a in args]
            outputs = original[i](*args)
            seen.append((i, inputs, [o.clone() for o in outputs]))
            return outputs
        return record
    try:
        for i in regions:
            steps[i].fn = recorded(i)
        engine(ids)
    finally:
        for i in regions:
            steps[i].fn = original[i]
    return seen


def test_a_norm_and_the_linears_it_feeds_run_as_one_htp_graph(htp_norms):
    """``export --backend qnn --placement norms``: each block norm and its linears one HTP graph (the
    norm at the engine's 16-bit encodings, the linears at 8 bits), on the simulator against the
    engine on its own inputs, then a whole prefill from the program alone."""
    from conftest import TINY_CHUNK

    from llmnpu_delegate.lower.npu_graph import holds_more_than_linears
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import sqnr_db, validate_pte

    engine, out, summary = htp_norms
    meta = json.loads(out.with_suffix(".json").read_text())
    regions = {e["index"]: e for e in meta["subgraphs"] if e.get("form") == "norm-region"}
    assert meta["placement"] == summary["placement"] == "norms"
    assert len(regions) == summary["npu_graphs"] == 2 * engine.kv.layers       # every block norm
    # the normed rows come out where a shadow product reads them, and only there (both kinds here)
    normed_out = [len(e["outputs"]) - len(e["linears"]) for e in regions.values()]
    assert normed_out == [int(any(engine.plans[n].shadow for n in e["linears"])) for e in regions.values()]
    assert set(normed_out) == {0, 1}
    for e in regions.values():         # the engine's encodings, as written
        enc = engine.program.npu.norms[(e["norm"]["layer"], e["norm"]["name"])]
        assert e["norm"]["x"] == {"scale": enc.x.scale, "zero": enc.x.zero, "bits": 16}
        assert e["norm"]["out"] == {"scale": enc.out.scale, "zero": enc.out.zero, "bits": 16}
    runner = PteRunner(out)
    seen = _region_io(engine, torch.randint(0, 1000, (4 * TINY_CHUNK,), generator=torch.Generator().manual_seed(9)),
                      set(regions))
    # every region of the engine's that holds more than linears is one
    assert {i for i, _, _ in seen} == set(regions) == {i for i, s in enumerate(engine.program.steps)
                                                       if s.sub.kind == "npu" and holds_more_than_linears(s.sub)}
    for i, inputs, want in seen:
        e = regions[i]
        enc = engine.program.npu.norms[(e["norm"]["layer"], e["norm"]["name"])].out
        k = next((j for j, name in enumerate(e["outputs"]) if name not in e["linear_outputs"]), None)
        if k is None:
            continue
        with torch.inference_mode():
            normed = runner.program.steps[i].fn(*inputs)[k]
        # HTP's RmsNorm at the output's 16-bit encoding, within one step of the engine's (measured:
        # 1.0; a float norm in the graph would be off the grid)
        codes = normed / enc.scale + enc.zero
        assert torch.allclose(codes, codes.round(), atol=1e-2)
        assert float(((normed - want[k]).abs() / enc.scale).round().max()) <= 1
    ids = torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(2))
    report = validate_pte(out, engine, ids, runner=runner)
    linears = [r for r in report["linears"] if r["subgraph"] in regions]
    assert len(linears) == sum(len(e["linears"]) for e in regions.values())
    # the 8-bit outputs: their rounding, and now and then an input code one apart, where the normed
    # value HTP requantizes to 8 bits is a 16-bit step from the engine's (measured at most 1.61 steps)
    assert min(r["within_2_steps"] for r in linears) >= 0.99, linears
    assert max(r["max_steps"] for r in linears) <= 2, linears
    assert min(r["sqnr_db"] for r in linears) > 30, linears       # measured 37.0-41.8
    prefill = report["prefill"]
    # measured 22.2 and 24.2 dB, the paper placement's program's gates
    assert prefill["same_next_token"] and prefill["logits_sqnr_db"] > 18 and prefill["kv_sqnr_db_min"] > 18
    vs = prefill["logits_sqnr_db_vs_fp32"]                  # measured 21.6 against the engine's 20.1
    assert vs["pte"] > vs["engine"] - 3, vs


@pytest.mark.parametrize("program", ["htp_norms", "htp_peak", "htp_attention"])
def test_the_native_runner_gives_the_python_runners_bits_on_an_htp_program_with_more_than_linears(
        program, request, tmp_path):
    """Both runners round a norm region's input to its norm's grid, pad an attention region's past to
    its window, make its mask and write its new K/V, and merge the linears' outputs alike: the same
    tokens and logits bit for bit over three chunks, cold rows hit and added in both."""
    from llmnpu_delegate.runtime.native import run_native
    from llmnpu_delegate.runtime.pte_runner import PteRunner

    _, out, _ = request.getfixturevalue(program)
    runner = PteRunner(out)
    ids = torch.randint(0, 1000, (90,), generator=torch.Generator().manual_seed(0))
    want = runner.generate(ids, 3)
    got = run_native(out, ids.tolist(), runner.meta, 3, logits_out=tmp_path / "l.bin")
    assert got.tokens == want.tokens and got.summary["cold_rows"] == want.cold_rows > 0
    ref = runner(ids).logits.numpy().reshape(-1)
    assert np.fromfile(tmp_path / "l.bin", dtype="<f4")[:ref.size].tobytes() == ref.tobytes()


def test_the_qnn_mode_runs_a_programs_norms_at_its_encodings(htp_norms):
    """``llmnpu eval --modes qnn`` of a norms program: every block norm of the scored model is the
    program's, at the encodings its sidecar writes, and gives the simulator's normed rows to a step."""
    from test_program_numerics import tiny_lm

    from llmnpu_delegate.evaluate import program_model
    from llmnpu_delegate.placed_numerics import _NpuNorm

    engine, out, _ = htp_norms
    meta = json.loads(out.with_suffix(".json").read_text())
    model, changed = program_model(tiny_lm(), out, engine.calibration, progress=False)
    norms = {n: m for n, m in model.named_modules() if isinstance(m, _NpuNorm)}
    assert changed["npu_norms"] == len(norms) == 2 * engine.kv.layers
    for e in (e for e in meta["subgraphs"] if e.get("form") == "norm-region"):
        mine = norms[f"model.layers.{e['norm']['layer']}.{e['norm']['name']}"].npu.enc
        assert (mine.x.scale, mine.x.zero, mine.out.scale, mine.weight.zero) == \
            (e["norm"]["x"]["scale"], e["norm"]["x"]["zero"], e["norm"]["out"]["scale"], e["norm"]["weight"]["zero"])
    seen = _first_calls(model, norms)
    from llmnpu_delegate.runtime.pte_runner import PteRunner

    runner = PteRunner(out)
    for e in (e for e in meta["subgraphs"] if e.get("form") == "norm-region"):
        x, ours = seen[f"model.layers.{e['norm']['layer']}.{e['norm']['name']}"]
        k = next((j for j, name in enumerate(e["outputs"]) if name not in e["linear_outputs"]), None)
        if k is None:
            continue
        with torch.inference_mode():
            htp = runner.program.steps[e["index"]].fn(x)[k]
        assert float(((htp - ours).abs() / e["norm"]["out"]["scale"]).round().max()) <= 1


# ------------------------------------------------------------------ the norm readers' peak products on HTP
@pytest.fixture(scope="module")
def htp_peak(tmp_path_factory):
    """The tiny engine under ``norms+peak`` with 70 % of its shadow paths, and its HTP program: each
    shadowed q/k/v and gate/up multiplies its peak channels' residues inside its norm's graph."""
    return _tiny_htp_program("norms+peak", tmp_path_factory.mktemp("htp-peak") / "tiny.pte")


def _peak_readers(engine, meta) -> tuple[dict, set]:
    regions = {e["index"]: e for e in meta["subgraphs"] if e.get("form") == "norm-region"}
    return regions, {n for e in regions.values() for n in e["linears"] if "peak" in meta["linears"][n]}


def test_the_norm_readers_peak_products_run_in_their_norms_htp_graph(htp_peak):
    """``export --backend qnn --placement norms+peak``: every shadowed norm reader's product over its
    peak channels is an output of its norm's HTP graph, and nothing of it runs on the CPU. On the
    simulator against the engine on its own inputs each linear lands within its 8-bit output's
    rounding, where the products alone move it by many steps; then a prefill from the program alone."""
    from conftest import TINY_CHUNK

    from llmnpu_delegate.backends.cpu_int8 import PeakProduct
    from llmnpu_delegate.kernels.npu_norm import npu_rms_norm
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import validate_pte

    engine, out, summary = htp_peak
    meta = json.loads(out.with_suffix(".json").read_text())
    regions, peaks = _peak_readers(engine, meta)
    assert meta["placement"] == summary["placement"] == "norms+peak" and len(regions) == 2 * engine.kv.layers
    readers = {n for e in regions.values() for n in e["linears"]}
    assert peaks == {n for n in readers if engine.plans[n].shadow} and summary["peak_products"] == len(peaks) >= 4
    assert all(meta["linears"][n]["peak"]["channels"] == engine.plans[n].peak.tolist() for n in peaks)
    # no CPU shadow product of theirs, and so no normed rows out of their graphs
    assert not peaks & {b["linear"] for e in meta["subgraphs"] for b in e.get("shadow", [])}
    assert all(e["outputs"] == e["linear_outputs"] for e in regions.values())
    # what the products weigh: the engine's, alone, in steps of each linear's 8-bit output
    ids = torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(2))
    steps = {}
    for i, inputs, _ in _region_io(engine, ids, set(regions)):
        e = regions[i]
        normed = npu_rms_norm(inputs[0], *_norm_of(engine, e))
        for n in peaks & set(e["linears"]):
            plan = engine.plans[n]
            product = PeakProduct(n, plan.clip, plan.peak, engine.backend.linear(n).weight)(normed)
            steps[n] = max(steps.get(n, 0.0), float(product.abs().max()) / meta["linears"][n]["output"]["scale"])
    # twice the bound below: a program without them would fail it (measured 6.6-104 steps)
    assert set(steps) == peaks and min(steps.values()) > 4, steps
    report = validate_pte(out, engine, ids, runner=PteRunner(out))
    linears = [r for r in report["linears"] if r["subgraph"] in regions]
    assert len(linears) == len(readers)
    # the same gates as without the products (measured: at most 1.61 steps, 38.6-42.1 dB)
    assert min(r["within_2_steps"] for r in linears) >= 0.99, linears
    assert max(r["max_steps"] for r in linears) <= 2, linears
    assert min(r["sqnr_db"] for r in linears) > 30, linears
    prefill = report["prefill"]
    assert prefill["same_next_token"] and prefill["logits_sqnr_db"] > 18 and prefill["kv_sqnr_db_min"] > 18
    vs = prefill["logits_sqnr_db_vs_fp32"]                  # measured 21.5 against the engine's 20.1
    assert vs["pte"] > vs["engine"] - 3, vs


def test_a_peak_products_grids_hold_whatever_its_normed_rows_can_give():
    """A peak product's 16-bit grids (``peak_grids``) span every residue and product its normed rows
    can give, from the rows' encoding and RMSNorm's own bound, not from calibration rows: rows each
    carrying one massive activation (the embedded model's first token: ~25,000) leave no residue or
    product saturated, so the product as the ``qnn`` mode computes it stays within its roundings of
    the exact one; and the grids are no wider than those rows reach."""
    import torch.nn.functional as F

    from llmnpu_delegate.kernels.npu_attention import Encoding
    from llmnpu_delegate.lower.norm_region import peak_grids
    from llmnpu_delegate.lower.program_numerics import PeakOnGrid
    from llmnpu_delegate.lower.pte import _peak_entry

    gen = torch.Generator().manual_seed(0)
    d, clip = 64, 0.5
    g = torch.rand(d, generator=gen) * 0.2 + 0.05
    g[[3, 17]] = torch.tensor([0.9, -0.6])                  # the norm weights of the peak channels
    weight = torch.randn(32, d, generator=gen) * 0.1
    channels = torch.tensor([3, 17, 40])
    normed_enc = Encoding.of_range(-12.0, 10.0, 16)         # |normed| reaches 8 * 0.9 = 7.2 < 10
    peak = peak_grids(weight, channels, clip, normed_enc, g)
    # one row per peak channel and sign, that channel at 25,000 and the rest modest
    x = torch.randn(2 * len(channels), d, generator=gen)
    for r, (c, sign) in enumerate((c, s) for c in channels.tolist() for s in (1, -1)):
        x[r, c] = sign * 25_000.0
    normed = normed_enc.round(F.rms_norm(x, (d,), g, 1e-5))
    ours = PeakOnGrid(_peak_entry(peak), weight)
    picked = normed[:, channels]
    residue = picked - picked.clamp(-clip, clip)
    hi, lo = float(residue.max()), float(residue.min())
    assert peak.residue.floor <= lo and hi <= peak.residue.ceiling
    exact = residue @ ours.weight.T
    rounding = (peak.residue.scale + ours.clamped.scale) / 2 * ours.weight.abs().sum(1) + peak.out.scale / 2
    assert bool(((ours(normed) - exact).abs() <= rounding + 1e-6).all())
    # tight: the rows reach within 1 % of the residue grid's ends
    assert hi > 0.99 * peak.residue.ceiling and lo < 0.99 * peak.residue.floor


def _norm_of(engine, entry) -> tuple:
    """(weight, eps, encodings) of a norm region's norm, as the engine runs it."""
    key = (entry["norm"]["layer"], entry["norm"]["name"])
    norm = engine.model.get_submodule(f"model.layers.{key[0]}.{key[1]}")
    return norm.weight.detach().float(), float(norm.variance_epsilon), engine.program.npu.norms[key]


def test_the_qnn_mode_computes_a_programs_peak_products_on_their_grids(htp_peak):
    """``llmnpu eval --modes qnn`` of a ``norms+peak`` program: each peak linear of the scored model
    adds the program's product (its channels, clip and 16-bit grids as written, W's columns at 8
    bits) and no CPU product, and gives the simulator's output to its 8-bit rounding, which the
    product alone is far from."""
    from test_program_numerics import tiny_lm

    from llmnpu_delegate.evaluate import program_model
    from llmnpu_delegate.placed_numerics import _NpuNorm
    from llmnpu_delegate.quantize.linear import QuantLinear
    from llmnpu_delegate.runtime.pte_runner import PteRunner

    engine, out, _ = htp_peak
    meta = json.loads(out.with_suffix(".json").read_text())
    regions, peaks = _peak_readers(engine, meta)
    model, changed = program_model(tiny_lm(), out, engine.calibration, progress=False)
    assert changed["peak_products"] == len(peaks)
    modules = dict(model.named_modules())
    assert {n for n, m in modules.items() if isinstance(m, QuantLinear) and m.npu_shadow is not None} == peaks
    seen = _first_calls(model, {n: m for n, m in modules.items() if isinstance(m, _NpuNorm) or n in peaks})
    runner = PteRunner(out)
    far = []
    for e in regions.values():
        x, _ = seen[f"model.layers.{e['norm']['layer']}.{e['norm']['name']}"]
        with torch.inference_mode():
            htp = dict(zip(e["outputs"], runner.program.steps[e["index"]].fn(x)))
        for n, lin_out in zip(e["linears"], e["linear_outputs"]):
            if n not in peaks:
                continue
            normed, ours = seen[n]
            step = max(o["scale"] for o in (meta["linears"][n]["output"], *meta["linears"][n]["split_outputs"]))
            got = htp[lin_out].reshape(ours.shape)
            # the 8-bit output's rounding and now and then an input code one apart (as without the
            # products), and the product's own 16-bit rounding
            bound = 2 * step + 2 * meta["linears"][n]["peak"]["out"]["scale"]
            assert float((got - ours).abs().max()) <= bound, n
            product = modules[n].npu_shadow(normed.reshape(-1, normed.shape[-1])).reshape(ours.shape)
            far.append(float((got - ours + product).abs().max()) / bound)
    # without its product every such linear leaves the bound (measured 1.9-47 times it)
    assert len(far) == len(peaks) and min(far) > 1.5, far


def _first_calls(model, watched: dict) -> dict:
    """name -> (input, output) of each of ``watched``'s modules at its first call, over a 32-token prompt."""
    seen = {}

    def keep(name):
        def hook(module, args, out):
            seen.setdefault(name, (args[0].clone(), out.clone()))
        return hook
    hooks = [m.register_forward_hook(keep(n)) for n, m in watched.items()]
    try:
        with torch.inference_mode():
            model(input_ids=torch.randint(0, 1000, (32,), generator=torch.Generator().manual_seed(3))[None])
    finally:
        for h in hooks:
            h.remove()
    return seen


@pytest.mark.parametrize("placement, match", [
    ("block", "on qnn, the norms"),
    ("norms+inline", "not inline"),
    ("attention+rope+norms+peak", "with attention in the same graph"),
])
def test_a_qnn_program_refuses_what_it_cannot_hold_before_writing(placement, match, tmp_path):
    from conftest import TINY_CHUNK, tiny_engine

    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.pte import export_pte

    engine = tiny_engine(placement=placement)
    with pytest.raises(LlmNpuError, match=match):
        export_pte(engine, tmp_path / "x.pte", torch.zeros(3 * TINY_CHUNK, dtype=torch.long),
                   ExportConfig(target="qnn", context=4 * TINY_CHUNK), progress=False)
    assert not any(tmp_path.iterdir())


# ------------------------------------------------------------------ attention-half as a QNN program
@pytest.fixture(scope="module")
def htp_attention(tmp_path_factory):
    """The tiny Qwen3 (q/k norms before RoPE) under ``attention-half`` with 30 % of its shadow paths
    (layer 1's o_proj reads attention's output inside its region, layer 0's has a shadow path and a
    region of its own), and its HTP program with 16-bit residual writers (``--residual-bits 16``: o_proj
    in both kinds of region, down_proj in its own). The embedded model's export covers llama's
    attention, with 8-bit ones, as do the other programs here."""
    return _tiny_htp_program("attention-half", tmp_path_factory.mktemp("htp-attention") / "tiny.pte",
                             "random:tiny-qwen3", pruning_rate=0.7, residual_bits=16)


def test_rope_attention_and_the_linears_it_feeds_run_as_one_htp_graph(htp_attention):
    """``export --backend qnn --placement attention-half``: each layer's RoPE -> attention (-> o_proj)
    one HTP graph against a fixed K/V window, on the simulator against the engine on its own inputs,
    then a whole prefill from the program alone."""
    from conftest import TINY_CHUNK
    from executorch.runtime import Runtime

    from llmnpu_delegate.format.npu_io import window_inputs
    from llmnpu_delegate.kernels.npu_attention import Encoding
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import sqnr_db, validate_pte

    engine, out, summary = htp_attention
    meta = json.loads(out.with_suffix(".json").read_text())
    regions = {e["index"]: e for e in meta["subgraphs"] if e.get("form") == "attention-region"}
    layers = engine.kv.layers
    assert summary["npu_forms"]["attention-region"] == len(regions) == layers
    assert summary["npu_forms"]["norm-region"] == 2 * layers               # and every block norm
    assert sorted(len(e["linears"]) for e in regions.values()) == [0, 1]    # both kinds
    for e in regions.values():
        att, enc = e["attention"], engine.program.npu.attention[e["attention"]["layer"]]
        assert att["window"] == 4 * TINY_CHUNK
        for k in ("q", "k", "v", "scores", "out"):          # the engine's encodings, as written
            assert Encoding(**att["encodings"][k]) == getattr(enc, k)
    runner = PteRunner(out)
    seen = _region_io(engine, torch.randint(0, 1000, (4 * TINY_CHUNK,), generator=torch.Generator().manual_seed(9)),
                      set(regions))
    assert len(seen) == 4 * layers
    for i, inputs, want in seen:
        e = regions[i]
        att = e["attention"]
        enc = engine.program.npu.attention[att["layer"]]
        with torch.inference_mode():
            got = dict(zip(e["outputs"], runner.program.steps[i].fn(*inputs)))
        want = dict(zip(e["outputs"], want))
        past = inputs[e["inputs"].index(att["past"][0])].shape[2]
        new_k, new_v = (got[n][:, :, past:] for n in att["present"])
        # the past comes back as it went in; V as given, or on the window's grid where the graph
        # writes it from its own copy (layer 1's, with o_proj); either way attention reads it
        # rounded there, as the engine does); K as the q/k norm and RoPE at 16 bits give it (on
        # RoPE's grid: the graph converts it to the window's where it reads it, and so does the next
        # chunk's), a few of the window's steps from the engine's rounded there (measured at most
        # 4.6, 1.0 on average; llama's, without the norm, 7 and 1.0)
        assert all(torch.equal(got[n][:, :, :past], inputs[e["inputs"].index(p)])
                   for n, p in zip(att["present"], att["past"]))
        # (half a step, and HTP's conversion's float error: measured 0.50011)
        assert (new_v - want[att["present"][1]][:, :, past:]).abs().max() <= 0.51 * enc.v.scale
        steps = (new_k - enc.k.round(want[att["present"][0]][:, :, past:])).abs() / enc.k.scale
        assert steps.max() <= 10 and steps.mean() <= 1.5, (float(steps.max()), float(steps.mean()))
        for name in (o for o in e["outputs"] if o not in att["present"] and o not in e["linear_outputs"]):
            # attention's output on its 16-bit grid, HTP's softmax its own approximation: measured
            # 1.2-1.4 steps on average, 65.3-69.2 dB, at most 7 steps but 17 in the first chunk,
            # whose first rows see a few keys (a row over one key weighs it a little under 1 there;
            # tiny-llama's, with larger values of V, 2.4-2.9, 62.8 dB, and 86 steps in that chunk)
            codes = got[name] / enc.out.scale + enc.out.zero
            assert torch.allclose(codes, codes.round(), atol=1e-2)
            steps = (got[name] - want[name]).abs() / enc.out.scale
            assert steps.mean() <= 4 and steps.max() <= 200 and sqnr_db(got[name], want[name]) > 55
    # the mask holds: whatever the window's empty slots hold, no query reads them
    def past_of(call) -> int:
        e = regions[call[0]]
        return call[1][e["inputs"].index(e["attention"]["past"][0])].shape[2]
    i, inputs, _ = next(call for call in seen if past_of(call))
    e, att, past = regions[i], regions[i]["attention"], past_of((i, inputs))
    method = Runtime.get().load_program(out).load_method(e["method"])
    args = window_inputs(e["inputs"], inputs, tuple(att["past"]), att["mask"], att["window"], att["mask_value"],
                         att["heads"])
    dirty = [a.clone() for a in args]
    for p, fill in zip(att["past"], (50.0, -50.0)):
        dirty[e["inputs"].index(p)][:, :, past:] = fill
    assert all(torch.equal(a, b) for a, b in zip(method.execute(args), method.execute(dirty)))
    ids = torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(2))
    report = validate_pte(out, engine, ids, runner=runner)
    graphs = {g["subgraph"]: g for g in report["npu_graphs"]}
    assert set(regions) <= set(graphs)
    assert min(graphs[i]["sqnr_db_min"] for i in regions) > 30      # measured 40.3 (o_proj), 68.6
    prefill = report["prefill"]
    # measured 34.1 and 29.5 dB (32.2 and 28.8 with 8-bit residual writers): within the paper program's gates
    assert prefill["same_next_token"] and prefill["logits_sqnr_db"] > 18 and prefill["kv_sqnr_db_min"] > 18
    vs = prefill["logits_sqnr_db_vs_fp32"]      # measured 25.9 against the engine's 25.7 (24.8 with 8-bit ones)
    assert vs["pte"] > vs["engine"] - 3, vs
    # the residual writers' products at 16 bits, HTP's within 2 of their steps (256 times finer than an
    # 8-bit output's: measured at most half a step, 86-91 dB); on the INT8 grid's own 16-bit codes
    # (``encodings.wide_activation_spec``) HTP's were up to 504 steps off
    wide = {n for n, lin in meta["linears"].items() if lin["output"]["bits"] == 16}
    assert wide == {n for n in meta["linears"] if n.endswith(("o_proj", "down_proj"))}
    assert all(lin["output"]["bits"] == 8 for n, lin in meta["linears"].items() if n not in wide)
    assert not any(meta["linears"][n]["fine_outputs"] for n in wide)
    rows = [r for r in report["linears"] if r["linear"] in wide]
    assert rows and min(r["within_2_steps"] for r in rows) >= 0.99, rows


def test_the_qnn_mode_runs_a_programs_attention_at_its_encodings(htp_attention):
    """``llmnpu eval --modes qnn`` of an attention-half program: every attention of the scored model
    at the encodings its sidecar writes, and its norms, the q/k norms inside the attention regions
    included, at theirs."""
    from test_program_numerics import tiny_lm

    from llmnpu_delegate.evaluate import program_model
    from llmnpu_delegate.placed_numerics import _ENCODINGS, attention_modules
    from llmnpu_delegate.prepare import norm_modules

    engine, out, _ = htp_attention
    model, changed = program_model(tiny_lm("random:tiny-qwen3"), out, engine.calibration, progress=False)
    assert changed["npu_attention"] == engine.kv.layers and changed["npu_norms"] == 4 * engine.kv.layers
    for layer, module in attention_modules(model).items():
        assert getattr(module, _ENCODINGS) == engine.program.npu.attention[layer]
    for key, norm in norm_modules(model).items():           # block and q/k norms swapped for the NPU's
        assert norm.npu.enc == engine.program.npu.norms[key], key
