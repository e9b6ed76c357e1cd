"""`llmnpu simulate`: the cost model against hand counts, the simulated schedule against a hand-worked
one, the real Scheduler under simulated time, device profiles and their sources, bad input."""
import math
from dataclasses import replace

import pytest

from llmnpu_delegate.cli import main
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.format.tasks import expand
from llmnpu_delegate.runtime import executor
from llmnpu_delegate.runtime.schedule import POLICIES, assign_costs, simulate
from llmnpu_delegate.runtime.trace import metrics
from llmnpu_delegate.simulate import cost, measured
from llmnpu_delegate.simulate.device import PARAMETERS, Device, load_device
from llmnpu_delegate.simulate.fit import fit_all, fit_roofline, table3_rows
from llmnpu_delegate.simulate.programs import PROGRAMS
from llmnpu_delegate.simulate.phone import carry_over, energy, prepare, simulate_prefill

C = 8   # chunk length of the tiny scenarios


@pytest.fixture(scope="module")
def tiny():
    """random:tiny-llama, shapes only, with q/k/v of layer 0 shadowed at a 1 % outlier share."""
    plan = {f"model.layers.0.self_attn.{p}_proj": 0.01 for p in "qkv"}
    return prepare("random:tiny-llama", C, pruning_rate=0.5, progress=False, plan=plan)


def toy_device(**overrides) -> Device:
    params = {p: 1.0 for p in PARAMETERS}
    params.update({"npu.a16_ops_per_s": 5e8, "npu.a8_speedup": 2.0, "npu.dram_bytes_per_s": 1e8, "npu.graph_launch_s": 1e-4,
                   "npu.io_bytes_per_s": 1e9, "cpu.float_ops_per_s": 1e8, "cpu.memory_bytes_per_s": 1e9,
                   "cpu.op_launch_s": 1e-6, "cpu.float_bytes": 2.0})
    params.update(overrides)
    return Device("TOY", "toy", params, {p: "test" for p in params}, None)


# ------------------------------------------------------------------ cost model against hand counts
def _qkv_region(scn):
    return next(s for s in scn.partition.subgraphs
                if s.kind == "npu" and any(n.endswith("q_proj") for n in s.linears) and s.layer == 0)


def test_flops_and_bytes_of_a_linear_region_match_a_hand_count(tiny):
    # tiny-llama: hidden 64, 4 heads of 16, 2 KV heads: q is 64 -> 64, k and v 64 -> 32 each
    sub = _qkv_region(tiny)
    w = cost.subgraph_work(sub, past=3 * C, float_bytes=2, outlier_rate={})
    n_out = 64 + 32 + 32
    assert w.flops == 2 * C * 64 * n_out
    assert w.weight_bytes == 64 * n_out                   # INT8: one byte per weight
    # three linears read the same [1, C, 64] input and write their outputs, at 2 bytes per float
    assert w.bytes == 3 * C * 64 * 2 + C * n_out * 2
    # the NPU graph: launch + per-GEMM roofline + its float inputs and outputs through memory
    dev = toy_device()
    gemms = sum(max(2 * C * 64 * n / 1e9, 64 * n / 1e8) for n in (64, 32, 32))
    io = (C * 64 + C * n_out) * 2
    assert cost.npu_seconds(sub, 3 * C, dev) == pytest.approx(1e-4 + gemms + io / 1e9, rel=1e-12)


@pytest.mark.parametrize("past", [0, C, 5 * C])
def test_attention_work_grows_with_the_keys_it_reads(tiny, past):
    att = next(s for s in tiny.partition.subgraphs if not s.static and s.layer == 0)
    node = next(n for n in att.nodes if n.target in cost.ATTENTION_TARGETS)
    w = cost.node_work(node, past, 2, {})
    heads, d, keys = 4, 16, past + C
    assert w.flops == 2 * 2 * heads * C * keys * d                 # QK^T and PV
    # reads q [4, C, d], k and v [2, keys, d] (grouped) and the boolean [C, keys] mask, writes [4, C, d]
    assert w.bytes == 2 * (heads * C * d + 2 * 2 * keys * d + heads * C * d) + C * keys


def test_shadow_cost_is_proportional_to_its_outliers(tiny):
    sub = next(s for s in tiny.partition.subgraphs if s.kind == "shadow" and s.layer == 0)
    none = cost.subgraph_work(sub, 0, 2, {})
    rates = dict(tiny.outlier_rate)
    some = cost.subgraph_work(sub, 0, 2, rates)
    double = cost.subgraph_work(sub, 0, 2, {k: 2 * v for k, v in rates.items()})
    # each outlier element multiplies one weight row of its linear's N outputs: 2 * (0.01 * C * 64) * N
    assert some.flops == pytest.approx(sum(2 * 0.01 * C * 64 * n for n in (64, 32, 32)))
    assert none.flops == 0 and double.flops == pytest.approx(2 * some.flops)


# ------------------------------------------------------------------ the simulated schedule by hand
# A -> B -> C per chunk; C of chunk i also needs C of chunk i-1 (its "past"). A, C on the CPU (1 s),
# B on the NPU (2 s).
TABLE = {"after": [[], [0], [1]], "after_previous": [[], [], [2]], "needed_kv": [0, 1, 2],
         "needed_final": [0, 1, 2], "processors": ["cpu", "npu", "cpu"]}
COSTS = {0: 1.0, 1: 2.0, 2: 1.0}


def _schedule(policy):
    tasks = expand(TABLE, 2)
    assign_costs(tasks, COSTS)
    return simulate(tasks, policy)


def test_inorder_schedule_matches_the_hand_worked_one():
    stats = _schedule("inorder")
    got = [(r.chunk, r.step, r.processor, r.start, r.end) for r in stats.records]
    assert got == [(0, 0, "cpu", 0, 1), (0, 1, "npu", 1, 3), (0, 2, "cpu", 3, 4),
                   (1, 0, "cpu", 4, 5), (1, 1, "npu", 5, 7), (1, 2, "cpu", 7, 8)]
    m = metrics(stats)
    assert stats.wall_s == 8 and m["npu_busy_s"] == 4 and m["npu_bubble_rate"] == pytest.approx(1 - 4 / 6)


def test_ooo_schedule_matches_the_hand_worked_one():
    # t=0 the CPU may run A0 or A1 (both feed 2 s of NPU work): the earlier chunk wins the tie.
    # t=1 the NPU takes B0 while the CPU runs A1; t=3 B1 and C0 start; t=5 C1.
    stats = _schedule("ooo")
    got = sorted((r.start, r.chunk, r.step, r.processor, r.end) for r in stats.records)
    assert got == [(0, 0, 0, "cpu", 1), (1, 0, 1, "npu", 3), (1, 1, 0, "cpu", 2),
                   (3, 0, 2, "cpu", 4), (3, 1, 1, "npu", 5), (5, 1, 2, "cpu", 6)]
    m = metrics(stats)
    assert stats.wall_s == 6 and m["npu_bubble_rate"] == 0.0 and m["bound_s"] == 4


def test_ooo_with_stealing_matches_the_hand_worked_ones():
    # Both lanes are cores of one CPU (the host). One chunk of two CPU subgraphs A, D (2 s each) that
    # feed B on the NPU (1 s). t=0 the NPU has nothing of its own: it takes the CPU's pick, A, while
    # the CPU runs D; t=2 B. Two units sooner than without stealing (A, D, B one after the other).
    table = {"after": [[], [], [0, 1]], "after_previous": [[], [], []], "needed_kv": [0, 1, 2],
             "needed_final": [0, 1, 2], "processors": ["cpu", "cpu", "npu"]}
    tasks = expand(table, 1)
    assign_costs(tasks, {0: 2.0, 1: 2.0, 2: 1.0})
    stats = simulate(tasks, "ooo", steal=True)
    got = sorted((r.start, r.step, r.processor, r.end) for r in stats.records)
    assert got == [(0, 0, "npu", 2), (0, 1, "cpu", 2), (2, 2, "npu", 3)] and stats.stolen == 1
    assert simulate(tasks, "ooo").wall_s == 5 and simulate(tasks, "ooo").stolen == 0
    # Two chunks of A -> B -> C: t=0 the NPU takes A0, and the idle CPU may not take A1 meanwhile
    # (a subgraph runs one call at a time) but starts it at 1; t=5 the NPU, idle, takes C1.
    tasks = expand(TABLE, 2)
    assign_costs(tasks, COSTS)
    stats = simulate(tasks, "ooo", steal=True)
    got = sorted((r.start, r.chunk, r.step, r.processor, r.end) for r in stats.records)
    assert got == [(0, 0, 0, "npu", 1), (1, 0, 1, "npu", 3), (1, 1, 0, "cpu", 2), (3, 0, 2, "cpu", 4),
                   (3, 1, 1, "npu", 5), (5, 1, 2, "npu", 6)]
    assert stats.wall_s == 6 and stats.stolen == 2


def test_the_policies_run_unchanged_under_simulated_time(tiny, monkeypatch):
    """simulate_prefill drives runtime.schedule's Scheduler (the threaded executor's object), never a copy."""
    calls = {p: 0 for p in POLICIES}
    real = executor.Scheduler.pick

    def spy(self, processor):
        calls[self.policy] += 1
        return real(self, processor)

    monkeypatch.setattr(executor.Scheduler, "pick", spy)
    r = simulate_prefill(tiny, "SM8650", 5 * C - 3)
    assert all(calls[p] > 0 for p in POLICIES) and set(r["policies"]) == set(POLICIES)
    walls = {p: r["policies"][p]["wall_s"] for p in POLICIES}
    assert walls["inorder"] >= max(walls["ooo"], walls["cp"], walls["overlap"])
    ooo = r["policies"]["ooo"]
    assert ooo["wall_s"] >= ooo["bound_s"] and ooo["tok_s"] == pytest.approx((5 * C - 3) / ooo["wall_s"])


def test_energy_integrates_busy_and_idle_power():
    dev = toy_device(**{"npu.power_busy_w": 2.0, "npu.power_idle_w": 0.5, "cpu.power_busy_w": 5.0,
                        "cpu.power_idle_w": 0.25})
    stats = _schedule("inorder")          # wall 8, NPU busy 4, CPU busy 4
    e = energy(stats, dev)
    assert e["npu"] == 2.0 * 4 + 0.5 * 4 and e["cpu"] == 5.0 * 4 + 0.25 * 4 and e["total"] == e["npu"] + e["cpu"]


# ------------------------------------------------------------------ device profiles
@pytest.mark.parametrize("soc", ["SM8550", "SM8650", "SM8750"])
def test_device_profiles_load_with_a_source_for_every_number(soc):
    dev = load_device(soc)
    assert set(PARAMETERS) <= set(dev.params)
    for name, value in dev.params.items():
        assert math.isfinite(value) and value > 0, name
        assert len(dev.sources[name]) > 20, name


def test_the_device_files_hold_the_fits_of_the_measurements_in_the_repository():
    """SM8750's fitted NPU and runtime rates are what fit.py gets from data/aihub.csv's training rows,
    SM8650's paper rates, paper launch and CPU rate what it gets from Table 3, every SoC's graph launch
    its fastest single-graph row; the other SoCs' rates are published ratios of those."""
    fits = fit_all()
    assert fits["unidentified"] == []
    assert set(fits["params"]) == {"SM8550", "SM8650", "SM8750", "SM8850"}
    for soc, params in fits["params"].items():
        dev = load_device(soc)
        for name, value in params.items():
            assert dev[name] == pytest.approx(value, rel=1e-3), (soc, name)
    table3 = load_device("SM8650")
    npu = fit_roofline(table3_rows(table3, "npu_int8_ms"))
    assert max(abs(e) for e in npu["row_errors"]) < 0.2      # the roofline explains every Table 3 row within 20 %
    base = load_device("SM8750")
    assert load_device("SM8650")["npu.a16_ops_per_s"] == pytest.approx(base["npu.a16_ops_per_s"] / 1.45)
    assert load_device("SM8850")["npu.a16_ops_per_s"] == pytest.approx(base["npu.a16_ops_per_s"] * 1.37)
    assert load_device("SM8550")["npu.a16_ops_per_s"] == pytest.approx(base["npu.a16_ops_per_s"] / 1.45 / 1.98)


def test_a_graph_launch_is_bounded_by_the_fastest_whole_graph_measured_on_its_soc():
    """Each SoC's QNN graph launch is its fastest single-graph row (and no row of that SoC is faster);
    the paper's program keeps its own runtime's launch, Table 3's intercept, about ten times that."""
    rows = measured.graph_executes()
    assert rows and all(r.source.startswith("qai-hub-models==0.65.0 models/") for r in rows)
    for soc in ("SM8550", "SM8650", "SM8750", "SM8850"):
        dev, own = load_device(soc), [r.seconds for r in rows if r.soc == soc]
        assert dev["npu.graph_launch_s"] == pytest.approx(min(own), rel=1e-3), soc
        assert dev["paper.graph_launch_s"] > 5 * dev["npu.graph_launch_s"], soc
    assert "0.046 ms" in load_device("SM8750").sources["npu.graph_launch_s"]


def test_each_program_pays_its_own_runtimes_launch(tiny):
    dev = toy_device(**{"paper.graph_launch_s": 7e-3})
    sub = _qkv_region(tiny)
    assert cost.npu_parts(sub, 0, dev)["launch"] == pytest.approx(1e-4)
    assert cost.npu_parts(sub, 0, dev, program=PROGRAMS["paper"])["launch"] == pytest.approx(7e-3)


def test_16_bit_residual_writers_run_at_the_matrix_units_16_bit_rate(tiny):
    """``ours-r16`` (``export --residual-bits 16``): o_proj's and down_proj's GEMMs at the 16-bit rate,
    the toy's half of the 8-bit one, by the hand count; q/k/v's as ours."""
    dev, r16 = toy_device(**{"npu.dram_bytes_per_s": 1e12}), PROGRAMS["ours-r16"]
    down = next(s for s in tiny.partition.subgraphs if s.kind == "npu" and s.layer == 0
                and any(n.endswith("down_proj") for n in s.linears))
    flops = 2 * C * 128 * 64        # tiny-llama: intermediate 128 -> hidden 64
    assert cost.npu_parts(down, 0, dev)["linears"] == pytest.approx(flops / 1e9)
    assert cost.npu_parts(down, 0, dev, program=r16)["linears"] == pytest.approx(flops / 5e8)
    qkv = _qkv_region(tiny)
    assert cost.npu_parts(qkv, 0, dev, program=r16) == cost.npu_parts(qkv, 0, dev)


def test_a_faster_npu_gives_a_faster_prefill(tiny):
    fast = simulate_prefill(tiny, "SM8750", 4 * C, ("ooo",))["policies"]["ooo"]
    slow = simulate_prefill(tiny, "SM8550", 4 * C, ("ooo",))["policies"]["ooo"]
    assert fast["npu_busy_s"] < slow["npu_busy_s"]


def test_a_plan_is_carried_over_by_depth_and_role():
    source = {"model.layers.0.self_attn.q_proj": 0.01, "model.layers.3.mlp.down_proj": 0.02}
    target = [f"model.layers.{i}.{n}" for i in range(8) for n in ("self_attn.q_proj", "self_attn.dense", "mlp.fc2")]
    out = carry_over(source, 4, target, 8)
    # target layer i sits at source depth round(i * 3 / 7): 0, 0, 1, 1, 2, 2, 3, 3
    assert out == {"model.layers.0.self_attn.q_proj": 0.01, "model.layers.1.self_attn.q_proj": 0.01,
                   "model.layers.6.mlp.fc2": 0.02, "model.layers.7.mlp.fc2": 0.02}


def test_an_automatic_pruning_rate_is_reported_as_the_rate_it_picked():
    """A random-weight model takes the embedded model's plan, and with it the rate that plan was
    chosen at for the SoC (the embedded calibration is cached by the tests before this file)."""
    from llmnpu_delegate.quantize import quant_config

    assert quant_config("w8a8-shadow", None).pruning_rate == "auto"
    scn = prepare("random:tiny-llama", C, progress=False)
    assert isinstance(scn.pruning_rate, float) and 0.0 <= scn.pruning_rate <= 1.0


def test_a_phone_prunes_the_paths_that_buy_time_as_far_as_the_accuracy_budget_allows():
    """Each path's price is its shadow product's cost in the CPU subgraph. On SM8650 the CPU lane bounds
    the prefill, so the embedded model's shadow products lengthen it beyond the 1 % allowed, and
    pruning shortens it: the accuracy budget stops the pruning (measured: 40 paths, 0.4022 -> 0.3956 s
    predicted, the held-apart KL 0.0053 -> 0.0104, within the budget's double)."""
    from llmnpu_delegate.models import load_model
    from llmnpu_delegate.partitioner.regions import shadow_delta
    from llmnpu_delegate.prepare import default_calibration
    from llmnpu_delegate.quantize import QuantConfig
    from llmnpu_delegate.quantize.auto import chosen
    from llmnpu_delegate.simulate import cost as costs
    from llmnpu_delegate.simulate.device import load_device
    from llmnpu_delegate.simulate.phone import choose_pruning, soc_shadow_prices

    scn = prepare("random:tiny-llama", C, pruning_rate=0.0, progress=False,
                  plan={"model.layers.0.mlp.down_proj": 0.02, "model.layers.1.self_attn.q_proj": 0.01})
    cost = soc_shadow_prices(scn, "SM8650", prompt_len=4 * C)
    device = load_device("SM8650")
    for sub in scn.partition.subgraphs:
        for node in sub.nodes:
            if node.op == "call_function" and node.target is shadow_delta:
                w = costs.node_work(node, 0, device["cpu.float_bytes"], scn.outlier_rate)
                want = device["cpu.op_launch_s"] + max(w.flops / device["cpu.float_ops_per_s"],
                                                       w.bytes / device["cpu.memory_bytes_per_s"])
                assert cost.seconds[node.args[1]] == pytest.approx(want, rel=1e-9)
                assert costs.node_work(node, 0, 2.0, {}).ops == 0      # pruned: it does not run

    lm = load_model("smollm2-135m")
    calib = default_calibration(lm, progress=False)
    config = QuantConfig(pruning_target="SM8650")
    choose_pruning(lm, calib, config, progress=False)
    choice = chosen(calib, config)
    assert choice["makespan_all_s"] > (1 + config.shadow_share) * choice["makespan_none_s"]
    assert choice["evaluations"] > 0 and choice["pruned"] and choice["rate"] > 0.0
    assert choice["makespan_s"] < choice["makespan_all_s"]
    assert choice["kl_all"] < choice["kl"] <= (1 + config.pruning_budget) * choice["kl_all"]


# ------------------------------------------------------------------ bad input
def test_an_unknown_soc_names_the_known_ones(capsys):
    with pytest.raises(LlmNpuError, match="unknown SoC 'SM0000': choose one of SM8550, SM8650, SM8750"):
        load_device("SM0000")
    assert main(["simulate", "--soc", "SM0000", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "SM8650" in err[0]


def test_a_prompt_past_the_context_is_refused(tiny):
    with pytest.raises(LlmNpuError, match=r"prompt length must be in 1\.\.4096"):
        simulate_prefill(tiny, "SM8650", 4097)
    with pytest.raises(LlmNpuError, match="unknown policy 'fifo': use one of inorder, overlap, ooo, cp"):
        simulate_prefill(tiny, "SM8650", 16, ("fifo",))
    with pytest.raises(LlmNpuError, match=r"in 1\.\.96 \(the model's context of 4096 after a past of 4000\)"):
        simulate_prefill(tiny, "SM8650", 97, past=4000)


def test_a_later_turn_pays_for_its_new_tokens_and_its_longer_past(tiny):
    """A prompt after a kept past runs only its own chunks; only its attention reads the past."""
    def predict(prompt_len, past=0):
        r = simulate_prefill(tiny, "SM8650", prompt_len, ("ooo",), past=past)
        return r["chunks"], r["policies"]["ooo"]

    first_chunks, first = predict(7 * C)
    later_chunks, later = predict(3 * C + 5, past=7 * C + 11)      # mid-chunk past, as a chat's turn
    fresh_chunks, fresh = predict(3 * C + 5)
    assert (first_chunks, later_chunks, fresh_chunks) == (7, 4, 4)
    assert later["wall_s"] < first["wall_s"]
    # the same new tokens cost more after a past (their attention reads it), by attention work only
    assert later["cpu_busy_s"] > fresh["cpu_busy_s"] and later["npu_busy_s"] == pytest.approx(fresh["npu_busy_s"])


def test_float_linears_are_not_simulated():
    with pytest.raises(LlmNpuError, match="--quant must be one of w8a8-shadow, w8a8"):
        prepare("random:tiny-llama", C, quant="fp32")


def test_a_7b_shape_is_simulated_without_its_weights():
    scn = prepare("random:llama-2-7b", 256, quant="w8a8", progress=False)
    r = simulate_prefill(scn, "SM8650", 512, ("ooo",))
    # 32 blocks of q, k, v, o, gate, up, down at 4096 x 4096 / 4096 x 11008: 2 * 256 * 6.48e6 FLOPs per block
    per_block = 4 * 4096 * 4096 + 3 * 4096 * 11008
    npu = sum(cost.subgraph_work(s, 0, 2, {}).flops for s in scn.partition.subgraphs if s.kind == "npu")
    assert npu == 2 * 256 * 32 * per_block
    assert r["policies"]["ooo"]["npu_busy_s"] > 0
    with pytest.raises(LlmNpuError, match="use it with `llmnpu simulate`"):
        from llmnpu_delegate.models import load_model
        load_model("random:phi-2")


def test_fp16_width_is_the_profiles(tiny):
    sub = _qkv_region(tiny)
    a = cost.npu_seconds(sub, 0, toy_device())
    b = cost.npu_seconds(sub, 0, replace(toy_device(), params={**toy_device().params, "cpu.float_bytes": 4.0}))
    assert b > a


def test_second_output_encodings_cost_their_share_of_the_npu_work(tiny):
    """A share s of the NPU outputs computed twice: the NPU lane's GEMMs take (1 + s) as long and
    the outputs' traffic grows, so its busy time grows by at most s plus the merge, at least s times
    the GEMMs' part; the CPU lane is untouched. A share outside [0, 1] is refused."""
    base, fine = (simulate_prefill(tiny, "SM8650", 2 * C, ("ooo",), fine_share=s)["policies"]["ooo"]
                  for s in (0.0, 0.1))
    gemm = sum(cost.npu_seconds(step.sub, 0, load_device("SM8650")) - load_device("SM8650")["npu.graph_launch_s"]
               for step in tiny.program.steps if step.sub.processor == "npu")
    grew = fine["npu_busy_s"] - base["npu_busy_s"]
    assert 0.1 * 0.5 * gemm * 2 < grew < 0.1 * base["npu_busy_s"] * 1.5, (grew, gemm, base["npu_busy_s"])
    assert fine["cpu_busy_s"] == pytest.approx(base["cpu_busy_s"])
    with pytest.raises(LlmNpuError, match="second encoding must be in"):
        simulate_prefill(tiny, "SM8650", C, ("ooo",), fine_share=1.5)


def test_the_sweep_predicts_and_scores_the_placement_asked_for(monkeypatch):
    """`simulate --sweep --placement P`: every point's program is partitioned with P (its prediction
    differs from the paper's split's) and the embedded model's perplexity is scored under P. The
    embedded model's part is recorded here, not run (its perplexity run: tests/test_evaluate.py)."""
    from llmnpu_delegate.simulate import phone

    scored, real_prepare = [], phone.prepare
    monkeypatch.setitem(phone._embedded, "model", "the embedded model")
    monkeypatch.setattr(phone, "tokenize", lambda lm, text: None)
    monkeypatch.setattr(phone, "eval_windows", lambda ids, window, tokens: None)
    monkeypatch.setattr(phone, "default_calibration", lambda lm, progress: None)
    monkeypatch.setattr(phone, "run_quantized", lambda *a, placed, **k: scored.append(placed) or {"ppl": 1.0})
    plan = {f"model.layers.0.self_attn.{p}_proj": 0.01 for p in "qkv"}
    monkeypatch.setattr(phone, "prepare", lambda *a, **k: real_prepare(*a, **k, plan=plan))
    rows = {p: phone.sweep("random:tiny-llama", "SM8750", 64, (0.0,), chunks=(C,), progress=False, placement=p)
            for p in ("paper", "block")}
    assert [r["placement"] for r in rows["block"]] == ["block"] and [p.name for p, _ in scored] == ["paper", "block"]
    assert rows["block"][0]["tok_s"] != rows["paper"][0]["tok_s"]
