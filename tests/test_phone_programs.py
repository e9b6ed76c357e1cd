"""The phone model's programs and its calibration: whole-NPU pricing against a hand count, the fit
against rows it must not read, the validation rows, the command line."""
import math

import pytest

from llmnpu_delegate.cli import main
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import model_config
from llmnpu_delegate.simulate import device as devices
from llmnpu_delegate.simulate import fit, measured
from llmnpu_delegate.simulate.device import PARAMETERS, Device, load_device, matrix_ops_per_s
from llmnpu_delegate.simulate.programs import PROGRAMS, get_program
from llmnpu_delegate.simulate.whole_npu import chunk_seconds, predict, shape


def toy() -> Device:
    params = {p: 1.0 for p in PARAMETERS}
    params.update({"npu.a16_ops_per_s": 1e9, "npu.a8_speedup": 2.0, "npu.fp16_ops_per_s": 2.5e8,
                   "npu.vector_elems_per_s": 1e7, "npu.dram_bytes_per_s": 1e8, "npu.graph_launch_s": 1e-3,
                   "cpu.kv_update_bytes_per_s": 1e6})
    return Device("TOY", "toy", params, {p: "test" for p in params}, None)


# tiny-llama: hidden 64, FFN 128, 2 blocks, 4 heads of 16, 2 K/V heads, vocabulary 49152
TINY = shape(model_config("random:tiny-llama"))


def test_a_whole_npu_chunk_costs_its_hand_count():
    genie, dev = PROGRAMS["genie"], toy()
    c, keys, graphs, context = 128, 512, 4, 512
    got = chunk_seconds(TINY, genie, dev, c, keys, graphs, context)
    wb = 0.5                                               # 4-bit weights
    linears = 2 * sum(max(2 * c * k * n / 1e9, k * n * wb / 1e8)
                      for k, n in [(64, 64), (64, 32), (64, 32), (64, 64), (64, 128), (64, 128), (128, 64)])
    assert got["linears"] == pytest.approx(linears)
    assert got["head"] == pytest.approx(max(2 * c * 64 * 49152 / 1e9, 64 * 49152 * wb / 1e8))
    assert got["attention"] == pytest.approx(2 * 4 * c * keys * 4 * 16 / 1e9)
    assert got["softmax"] == pytest.approx(2 * c * keys * 4 / 1e7)
    assert got["elementwise"] == pytest.approx(2 * c * (4 * 64 + 2 * (64 + 32) + 2 * 128) / 1e7)
    assert got["kv_read"] == pytest.approx(2 * 2 * keys * 32 * 1 / 1e8)          # 8-bit K/V
    assert got["launch"] == pytest.approx(graphs * 1e-3)
    assert got["kv_update"] == pytest.approx(2 * 2 * context * 32 / 1e6)


def test_activation_precision_sets_the_matrix_rate():
    dev = toy()
    assert (matrix_ops_per_s(dev, "a8"), matrix_ops_per_s(dev, "a16"), matrix_ops_per_s(dev, "fp16")) == (2e9, 1e9, 2.5e8)
    a16 = chunk_seconds(TINY, PROGRAMS["genie"], dev, 128, 128, 1, 128)
    fp16 = chunk_seconds(TINY, PROGRAMS["genie-fp16"], dev, 128, 128, 1, 128)
    assert fp16["attention"] == pytest.approx(4 * a16["attention"])
    # ExecuTorch's recipes: 16a8w's matrix work at the a16 rate, 8a8w's at a8, their K/V at 16 and 8 bits
    et16, et8 = (chunk_seconds(TINY, PROGRAMS[f"executorch-{r}"], dev, 128, 128, 1, 128)
                 for r in ("16a8w", "8a8w"))
    assert et16["attention"] == pytest.approx(a16["attention"])
    assert et8["attention"] == pytest.approx(a16["attention"] / 2)
    assert et16["kv_read"] == pytest.approx(2 * et8["kv_read"])
    assert et16["kv_update"] == pytest.approx(2 * et8["kv_update"])


def test_a_fixed_window_pays_the_context_a_growing_one_pays_its_past():
    config, dev = model_config("random:tiny-llama"), toy()
    fixed = predict(config, PROGRAMS["genie"], dev, 256, 1024)
    # two chunks, each against the whole window; the K/V update between them only (none after the last)
    one = chunk_seconds(TINY, PROGRAMS["genie"], dev, 128, 1024, 4, 1024)
    assert fixed["chunks"] == 2
    assert fixed["seconds_by_kind"]["attention"] == pytest.approx(2 * one["attention"])
    assert fixed["seconds_by_kind"]["kv_update"] == pytest.approx(one["kv_update"])
    assert fixed["cpu_busy_s"] == pytest.approx(one["kv_update"])
    assert fixed["wall_s"] == pytest.approx(fixed["npu_busy_s"] + fixed["cpu_busy_s"])
    # llama.cpp: 700 tokens are 512 + 188 rows (no padding), the second batch attending over all 700
    grow = predict(config, PROGRAMS["llamacpp-hexagon"], dev, 700, 4096)
    a = chunk_seconds(TINY, PROGRAMS["llamacpp-hexagon"], dev, 512, 512, 1, 4096)
    b = chunk_seconds(TINY, PROGRAMS["llamacpp-hexagon"], dev, 188, 700, 1, 4096)
    assert grow["seconds_by_kind"]["attention"] == pytest.approx(a["attention"] + b["attention"])
    assert grow["cpu_busy_s"] == 0.0 and grow["tok_s"] == pytest.approx(700 / grow["wall_s"])


def test_the_training_rows_are_the_declared_rule_and_every_other_row_validates():
    rows = measured.measurements()
    train = [m for m in rows if m.training]
    assert train and all(m.soc == "SM8750" and m.size_b <= 2.0 and m.runtime in ("genie", "geniex_qairt")
                         for m in train)
    others = [m for m in rows if not m.training]
    assert {m.soc for m in others} == {"SM8750", "SM8850"} and any(m.size_b > 2 for m in others)
    assert any(m.runtime == "geniex_llamacpp" for m in others)
    assert all(m.source.startswith("qai-hub-models==0.65.0 models/") for m in rows)


def test_the_fit_never_reads_a_validation_row(monkeypatch):
    """Scaling every validation row's measurement tenfold leaves the fit exactly as it was."""
    base = fit.fit_all()["params"]
    scaled = tuple(m if m.training else measured.Measurement(**{**m.__dict__, "prefill_tok_s": 10 * m.prefill_tok_s})
                   for m in measured.measurements())
    monkeypatch.setattr(measured, "measurements", lambda: scaled)
    again = fit.fit_all()["params"]
    assert again["SM8750"] == base["SM8750"]


def test_the_fit_moves_with_its_training_rows(monkeypatch):
    """Training rows twice as fast give a matrix unit about twice as fast: the fit reads them."""
    base = fit.fit_all()["params"]["SM8750"]
    doubled = tuple(measured.Measurement(**{**m.__dict__, "prefill_tok_s": 2 * m.prefill_tok_s}) if m.training else m
                    for m in measured.measurements())
    monkeypatch.setattr(measured, "measurements", lambda: doubled)
    again = fit.fit_all()["params"]["SM8750"]
    assert again["npu.a16_ops_per_s"] > 1.5 * base["npu.a16_ops_per_s"]


def test_the_validation_errors_stay_where_they_were_measured():
    """As measured when the model was fitted (docs/simulate.md): the validation rows' median error 15.6 %,
    49 of 75 rows within +-25 %; the training rows' median 19.0 %. A change to the model or the data that
    makes it worse fails here."""
    v = measured.validation()
    s, t = v["summary"], v["training_summary"]
    assert s["rows"] == 75 and t["rows"] == 15
    assert s["median_abs_error"] <= 0.16 and s["within_25"] >= 49
    assert t["median_abs_error"] <= 0.19
    for r in v["rows"]:
        assert math.isfinite(r["error"]) and r["predicted_tok_s"] > 0


def test_a_profile_that_scales_itself_in_a_circle_is_refused(monkeypatch):
    monkeypatch.setattr(devices, "_profile", lambda soc: {"name": soc, "params": {
        "npu.a16_ops_per_s": {"scale_of": "B" if soc == "A" else "A", "by": 1.0, "source": "a circle of scales"}}})
    with pytest.raises(LlmNpuError, match="scales itself"):
        devices._param("A", "npu.a16_ops_per_s")


def test_an_unknown_program_is_refused_in_one_line(capsys):
    with pytest.raises(LlmNpuError, match="unknown program 'mlc': choose one of ours, ours-r16, paper, genie"):
        get_program("mlc")
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--program", "mlc", "--no-progress"])
    assert exit.value.code == 2 and "invalid choice: 'mlc'" in capsys.readouterr().err


def test_simulate_predicts_a_peer_program(capsys):
    assert main(["simulate", "--model", "random:qwen3-0.6b", "--soc", "SM8750", "--program", "genie",
                 "--prompt-len", "1024", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "in 8 chunks of 128 (4 graph executes each), each against a fixed K/V window of 1024" in out
    assert "where the time goes: linears" in out
    assert main(["simulate", "--program", "genie", "--sweep", "--no-progress"]) == 2
    assert "--sweep and --past simulate our program's schedule" in capsys.readouterr().err
    assert main(["simulate", "--model", "random:qwen3-0.6b", "--program", "genie", "--prompt-len", "600",
                 "--context", "512", "--no-progress"]) == 2
    assert "must hold the prompt of 600 tokens" in capsys.readouterr().err


def test_our_program_is_set_beside_the_peer_on_the_same_model(capsys):
    """`llmnpu simulate` of ours carries the Genie form's prediction for the same model, SoC and
    prompt (what `--program genie` prints), and its ratios are ooo's against it."""
    import json

    from llmnpu_delegate.cli.simulate import _format_simulate

    args = ["simulate", "--model", "random:tiny-llama", "--soc", "SM8750", "--prompt-len", "200", "--chunk", "16",
            "--placement", "paper", "--pruning-rate", "1.0", "--policies", "ooo", "--no-progress", "--json"]
    assert main(args) == 0
    r = json.loads(capsys.readouterr().out)
    want = predict(model_config("random:tiny-llama"), PROGRAMS["genie"], load_device("SM8750"), 200, 256)
    assert r["peer"]["program"] == "genie" and r["peer"]["tok_s"] == pytest.approx(want["tok_s"])
    assert main(["simulate", "--model", "random:tiny-llama", "--soc", "SM8750", "--prompt-len", "200",
                 "--program", "genie", "--json", "--no-progress"]) == 0
    assert json.loads(capsys.readouterr().out)["tok_s"] == pytest.approx(want["tok_s"])
    line = next(ln for ln in _format_simulate(r).splitlines() if ln.startswith("beside --program genie"))
    ooo = r["policies"]["ooo"]
    assert f"{ooo['tok_s'] / want['tok_s']:.2f}x its speed" in line
    assert f"{ooo['energy_j'] / want['energy_j']:.2f}x its energy" in line
    assert main(args[:6] + ["32", *args[7:], "--past", "16"]) == 0
    assert "peer" not in json.loads(capsys.readouterr().out)      # no fixed-window form of a kept past


def test_our_program_is_bounded_by_the_lane_the_breakdown_names():
    from llmnpu_delegate.simulate.phone import prepare, simulate_prefill

    scn = prepare("random:tiny-llama", 8, pruning_rate=1.0, progress=False)
    r = simulate_prefill(scn, "SM8750", 32, ("ooo",))
    ooo = r["policies"]["ooo"]
    assert sum(r["lanes"]["npu"].values()) == pytest.approx(ooo["npu_busy_s"])
    assert sum(r["lanes"]["cpu"].values()) == pytest.approx(ooo["cpu_busy_s"])
    assert r["lanes"]["cpu"]["attention"] > 0 and r["lanes"]["npu"]["launch"] > 0
    with pytest.raises(LlmNpuError, match="runs everything on the NPU"):
        simulate_prefill(scn, "SM8750", 32, ("ooo",), program=PROGRAMS["genie"])
    # the paper's own rates are slower than what a QNN program reaches
    paper = simulate_prefill(scn, "SM8750", 32, ("ooo",), program=PROGRAMS["paper"])["policies"]["ooo"]
    assert paper["npu_busy_s"] > ooo["npu_busy_s"]
    assert load_device("SM8750")["paper.int8_ops_per_s"] < matrix_ops_per_s(load_device("SM8750"), "a8")
