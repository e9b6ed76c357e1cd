"""The ``qnn`` evaluation mode (``lower/program_numerics.py``) against the program it reproduces.

Here the program is the tiny model's cpu-int8 export with 8-bit outputs (the encodings a ``qnn``
program has, run by XNNPACK on this host); tests/test_qnn.py holds the same checks against an HTP
program on Qualcomm's simulator."""
import json
import shutil

import pytest
import torch
from conftest import TINY_CHUNK as CHUNK, outlier_model

from llmnpu_delegate import kernels as K
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.format.sidecar import sidecar_digest
from llmnpu_delegate.evaluate import evaluate, program_model, quantized_model
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import QuantLinear
from llmnpu_delegate.runtime.pte_runner import PteRunner
from llmnpu_delegate.runtime.validate import capture_npu_io, element_steps, sqnr_db


def tiny_lm(spec="random:tiny-llama"):
    """The tiny engine's model, as tiny_engine builds it (its weights and injected outliers)."""
    return outlier_model(spec)


def method_gaps(engine, pte, model, ids) -> dict[str, dict]:
    """Per NPU linear, between what the program's method returns and what the mode's linear computes
    before its shadow path, on the engine's input rows of a chunk of ``ids``: the largest distance in
    steps of its output encoding, the share of elements a code apart, and how far from halfway
    between two codes the exact product of those elements lies (in steps; 0 when none are apart)."""
    runner = PteRunner(pte)
    quant = {n: m for n, m in model.named_modules() if isinstance(m, QuantLinear)}
    gaps = {}
    for io in capture_npu_io(engine, ids):
        got = runner.program.steps[io.step].fn(io.rows)
        for name, out in zip(io.names, got):
            q = quant[name]
            exact = K.w8a8_linear(io.rows, q.full_scale if q.pruned else q.act_scale, q.weight_q, q.weight_scale,
                                  q.bias)
            ours = q.output_stage(exact)
            step, _ = element_steps(runner.meta["linears"][name], ours)
            apart = (out - ours).abs() / step
            off = apart > 0.5
            where = exact / step
            gaps[name] = {"steps": float(apart.max()), "share": float(off.float().mean()),
                          "tie": float(((where - where.floor())[off] - 0.5).abs().max()) if off.any() else 0.0}
    return gaps


@pytest.fixture(scope="module")
def engine(shared_tiny_engine):
    return shared_tiny_engine


@pytest.fixture(scope="module")
def program(tiny_8bit):
    return tiny_8bit


@pytest.fixture(scope="module")
def mode_model(engine, program):
    return program_model(tiny_lm(), program, engine.calibration, progress=False)


def test_every_npu_output_is_the_programs(engine, program, mode_model):
    """Each NPU method's outputs (8-bit, split groups, second encodings merged) are the mode's
    linears' grid points: both round the same integer product to the same encodings (measured: 0
    steps apart on every linear; a requantization landing on a tie could round either way, which
    HTP's does on the simulator, test_qnn.py)."""
    model, changed = mode_model
    meta = json.loads(program.with_suffix(".json").read_text())
    assert changed["linears"] == len(meta["linears"]) and changed["fine_outputs"] >= len(meta["linears"])
    assert changed["pruned"] == len(meta["pruned_layers"]) > 0 and changed["head"] == "int8"
    ids = torch.randint(0, 1000, (CHUNK,), generator=torch.Generator().manual_seed(5))
    gaps = method_gaps(engine, program, model, ids)
    assert len(gaps) == len(meta["linears"])
    assert max(g["steps"] for g in gaps.values()) < 1e-3, gaps


def test_prefill_logits_are_the_programs_not_the_engines(engine, program, mode_model):
    """The mode's logits at a prompt's last token are the program's, far closer than the engine's
    (float NPU outputs, float head) are: the test sees the requantization and the INT8 head. Measured
    86 dB against the engine's 28; the gate asks for a tenth of the engine's gap (20 dB more)."""
    model, _ = mode_model
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(4))
    want = PteRunner(program)(ids).logits.reshape(-1)
    with torch.inference_mode():
        ours = model(input_ids=ids[None], use_cache=False).logits[0, -1].float()
    engine_db, ours_db = sqnr_db(engine(ids).logits.reshape(-1), want), sqnr_db(ours, want)
    print(f"logits against the program's: qnn mode {ours_db:.1f} dB, engine {engine_db:.1f} dB")
    assert ours_db > engine_db + 20, (ours_db, engine_db)


def test_eval_reports_the_program_and_refuses_what_it_cannot_reproduce(engine, program, tmp_path, monkeypatch):
    """``evaluate`` with the mode gives a perplexity beside the others' and what it applied; a program
    with float outputs, the mode without a program, and a program of another model are refused."""
    from llmnpu_delegate import evaluate as harness

    lm = tiny_lm()
    monkeypatch.setattr(harness, "load_or_calibrate", lambda *a, **k: engine.calibration)   # the program's
    ids = torch.randint(0, 1000, (600,), generator=torch.Generator().manual_seed(6))
    result = evaluate(lm, ids, ids, ["w8a8-shadow", "qnn"], window=64, max_tokens=256, progress=False,
                      program=program)
    assert result["results"]["qnn"]["program"] == str(program) and result["results"]["qnn"]["ppl"] > 1
    with pytest.raises(LlmNpuError, match="--pte PATH"):
        evaluate(lm, ids, ids, ["qnn"], window=64, max_tokens=256, progress=False)
    with pytest.raises(LlmNpuError, match="--pte PATH"):
        evaluate(lm, ids, ids, ["w8a8"], window=64, max_tokens=256, progress=False, program=program)
    floats = json.loads(program.with_suffix(".json").read_text())      # as a float-output export writes it
    for lin in floats["linears"].values():
        lin.update(output={"bits": 32}, split_outputs=[], split_channels=[], fine_outputs=[])
    floats["sidecar_sha256"] = sidecar_digest(floats)
    shutil.copy(program, tmp_path / "float.pte")
    (tmp_path / "float.json").write_text(json.dumps(floats))
    with pytest.raises(LlmNpuError, match="32-bit NPU outputs .*--output-bits 8"):
        program_model(lm, tmp_path / "float.pte", engine.calibration, progress=False)
    other = load_model("random:tiny-qwen3")
    with pytest.raises(LlmNpuError, match="not from random:tiny-qwen3"):
        program_model(other, program, engine.calibration, progress=False)


def test_a_program_of_other_activation_scales_is_refused(program):
    """The mode quantizes the model with the calibration it is given: one whose scales are not the
    program's is refused in one line, not evaluated as if it were."""
    from llmnpu_delegate.quantize import CalibConfig, calibrate

    lm = tiny_lm()
    # another calibration, made in memory: a cached one here would be filed under the model before
    # its outliers were injected (tiny_lm keeps the loaded model's fingerprint, as tiny_engine does),
    # and a later command loading random:tiny-llama would read it
    other = calibrate(lm.model, torch.randint(0, 1000, (1024,), generator=torch.Generator().manual_seed(5)),
                      lm.fingerprint, CalibConfig(samples=2, tokens=128, probe_tokens=128), progress=False)
    with pytest.raises(LlmNpuError, match="activation scale differs from the program's"):
        program_model(lm, program, other, progress=False)


def test_quantized_model_keeps_float_outputs_without_a_program(engine):
    """The other modes are untouched: no output stage, the float head."""
    model, _ = quantized_model(tiny_lm(), engine.quant, engine.calibration, progress=False)
    assert all(m.output_stage is None for m in model.modules() if isinstance(m, QuantLinear))
    assert isinstance(model.get_output_embeddings(), torch.nn.Linear)


def test_lm_eval_scores_with_the_programs_numerics(engine, program, mode_model):
    """``--model llmnpu --model_args quant=qnn,pte=PATH``: the adapter's log-likelihoods are the mode's
    own (not the engine's numerics, which score apart); it refuses to generate, in one line."""
    from conftest import missing

    pytest.importorskip("lm_eval", reason=missing("lm-eval (the eval extra)"))
    from llmnpu_delegate.harness.lm import LlmNpuLM

    ctx, cont = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(7)).tolist(), [7, 8, 9]
    request = [(("", ""), ctx, cont)]
    adapter = LlmNpuLM(tiny_lm(), quant="qnn", pte=str(program), calibration=engine.calibration)
    got = adapter._loglikelihood_tokens(request)[0][0]
    with torch.inference_mode():
        logits = mode_model[0](input_ids=torch.tensor([ctx + cont]), use_cache=False).logits[0, len(ctx) - 1:-1]
    want = float(torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(cont)[:, None]).sum())
    shadow = LlmNpuLM(tiny_lm(), quant="w8a8-shadow", calibration=engine.calibration)._loglikelihood_tokens(request)[0][0]
    assert abs(got - want) < 1e-4 * abs(want), (got, want)
    assert abs(shadow - got) > 100 * abs(got - want), (shadow, got, want)

    class Request:
        args = ("Once", {"max_gen_toks": 2})
    with pytest.raises(LlmNpuError, match="does not generate"):
        adapter.generate_until([Request()])


def test_the_eval_command_asks_for_the_program(capsys):
    """``llmnpu eval --modes qnn`` without ``--pte`` stops before loading anything, in one line."""
    from llmnpu_delegate.cli import main

    assert main(["eval", "--model", "random:tiny-llama", "--modes", "qnn", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--pte PATH" in err[0], err


def test_the_head_quantizes_each_row_over_its_own_range():
    """The mode's INT8 head against the kernels' plain-integer reference of a dynamic INT8 linear,
    called one row at a time (each row its own range); one range over all rows would differ."""
    from llmnpu_delegate.kernels.ops import dynamic_linear_reference, quantize_weight
    from llmnpu_delegate.lower.program_numerics import DynamicInt8Head

    g = torch.Generator().manual_seed(9)
    weight = torch.randn(300, 64, generator=g)
    x = torch.randn(5, 64, generator=g) * torch.tensor([0.1, 1.0, 10.0, 3.0, 0.5])[:, None]
    w_q, w_scale = quantize_weight(weight, "channel")
    got = DynamicInt8Head(weight)(x)
    rows = torch.cat([dynamic_linear_reference(r[None], w_q, w_scale, reduce_range=False) for r in x])
    one_range = dynamic_linear_reference(x, w_q, w_scale, reduce_range=False)
    assert (got - rows).abs().max() <= 1e-6 * rows.abs().max()
    assert (got - one_range).abs().max() > 1e-2 * rows[0].abs().max()
