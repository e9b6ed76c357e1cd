"""Placement: which pieces of a block run on the NPU beside the linears. The cut under each placement
against the uncut step, the pieces each moves, the graph splits a shadow merge makes, the phone
model's pricing of NPU pieces against hand counts, the choice by predicted prefill, the backends'
capability tables and the CLI's --placement and --why."""
import contextlib
import dataclasses
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from llmnpu_delegate import backends
from llmnpu_delegate.backends.cpu_int8 import ShadowDelta
from llmnpu_delegate.chunk_step import example_inputs
from llmnpu_delegate.cli import main
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model
from llmnpu_delegate.partitioner.placement import INLINE, MERGE, PEAK, PIECES, PRESETS, layer_of, parse_placement
from llmnpu_delegate.partitioner.regions import is_linear, peak_delta, shadow_delta, subgraph_module
from llmnpu_delegate.quantize import quantizable_linears
from llmnpu_delegate.runtime.engine_config import EngineConfig
from llmnpu_delegate.simulate import cost
from llmnpu_delegate.simulate.device import matrix_ops_per_s
from llmnpu_delegate.simulate.programs import get_program
from llmnpu_delegate.simulate.phone import choose_placement, prepare, simulate_prefill, soc_shadow_prices, with_shadowed

from test_partitioner import CHUNK, _partition, exported, llama  # noqa: F401  (its tiny-llama step)
from test_simulate import toy_device



def _cut(llama, exported, placement, shadowed=()):
    return _partition(llama, exported, placement=placement, shadowed=shadowed)


def _npu_nodes(partition):
    return {n for s in partition.by_kind("npu") for n in s.nodes}


def _run_cut(partition, inputs: dict) -> list:
    """Every subgraph in program order, each a standalone float GraphModule."""
    values = dict(inputs)
    for sub in partition.subgraphs:
        outs = subgraph_module(partition, sub)(*[values[n] for n in sub.inputs])
        values.update(zip(sub.outputs, outs))
    return [values[n] for n in partition.graph_outputs]


@pytest.mark.parametrize("placement", list(PRESETS) + ["rope+act", "paper+inline", "norms+inline"])
def test_every_placement_cuts_the_step_without_changing_what_it_computes(llama, exported, placement):
    past = 5
    ids, pos, last, pk, pv = example_inputs(llama.model.config, CHUNK, past)
    ids = torch.randint(0, llama.model.config.vocab_size, ids.shape, generator=torch.Generator().manual_seed(0))
    pk = [torch.randn_like(t) for t in pk]
    pv = [torch.randn_like(t) for t in pv]
    want = torch.utils._pytree.tree_leaves(exported.module()(ids, pos, last, pk, pv))
    p = _cut(llama, exported, placement)
    names = p.graph_inputs
    got = _run_cut(p, dict(zip(names, [ids, pos, last, *pk, *pv])))
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=0)     # the same ops in the same order


def _ops(nodes, name):
    """The nodes of ``name``'s op inside the decoder blocks (the final norm is not a block's)."""
    return {n for n in nodes if n.op == "call_function" and name in str(n.target) and layer_of(n) is not None}


@pytest.mark.parametrize("piece, marker", [("attention", "chunk_attention"), ("norms", "rsqrt"),
                                           ("rope", "neg"), ("act", "silu")])
def test_each_piece_moves_to_the_npu_alone(llama, exported, piece, marker):
    p = _cut(llama, exported, piece)
    everything = list(p.graph_module.graph.nodes)
    assert _ops(everything, marker) and _ops(everything, marker) <= _npu_nodes(p)
    for other, other_marker in (("attention", "chunk_attention"), ("norms", "rsqrt"), ("rope", "neg"), ("act", "silu")):
        if other != piece:
            assert not _ops(_npu_nodes(p), other_marker), f"{other} moved with {piece}"
    paper = _cut(llama, exported, "paper")
    assert not any(_ops(_npu_nodes(paper), m) for m in ("chunk_attention", "rsqrt", "neg", "silu"))


def test_an_npu_graph_ends_at_each_linears_output_and_at_each_shadow_merge(llama, exported):
    layers = llama.model.config.num_hidden_layers
    whole = _cut(llama, exported, "block")
    assert all(s.processor == "cpu" for s in whole.subgraphs if s.layer is None)     # prologue and head
    # NPU work that reads a linear's output starts a graph of its own. Per block: RoPE -> attention ->
    # o_proj; the residual add -> norm -> gate/up; the activation -> down; the second residual add
    # (-> the next block's norm -> q/k/v). Before them, the first block's norm -> q/k/v
    regions = whole.by_kind("npu")
    assert len(regions) == 4 * layers + 1
    for sub in regions:
        inside = {n for n in sub.nodes}
        made = {n for n in sub.nodes if n.op == "call_function" and "linear" in str(n.target)}
        assert not any(u in inside for n in made for u in n.users), f"subgraph {sub.index} reads its own linear"
    # a shadowed q (q/k/v share one input: one merge point) and a shadowed down in each block: each
    # merge is CPU work feeding the NPU, and reads a linear's output, so each one ends a graph where
    # the linear's output already did: the count stays
    shadowed = [f"model.layers.{i}.{m}" for i in range(layers) for m in ("self_attn.q_proj", "mlp.down_proj")]
    split = _cut(llama, exported, "block", shadowed=shadowed)
    assert len(split.by_kind("npu")) == len(regions)
    assert sum(s.kind == "shadow" for s in split.subgraphs) == len(shadowed)
    # merged on the CPU instead, the merge and everything after it up to the next linear stay there
    apart = _cut(llama, exported, "attention+rope+norms+residual+act", shadowed=shadowed)
    assert any("merge" in r for r in apart.why.values())


@pytest.mark.parametrize("base", ["paper", "norms"])
def test_an_inline_shadow_product_runs_in_the_task_that_merges_it(llama, exported, base):
    shadowed = [n for n in quantizable_linears(llama.model) if "lm_head" not in n]
    beside, inline = _cut(llama, exported, base, shadowed), _cut(llama, exported, f"{base}+inline", shadowed)
    assert inline.placement.inline and inline.placement.name == f"{base}+inline"

    def homes(p):       # each shadow product's subgraph, and its merge's
        where = {n: s for s in p.subgraphs for n in s.nodes}
        return [(where[m], where[u]) for m in where if m.op == "call_function" and m.target is shadow_delta
                for u in m.users]
    assert homes(inline) and all(a is b and a.kind == "cpu" for a, b in homes(inline))
    assert not inline.by_kind("shadow") and len(inline.subgraphs) < len(beside.subgraphs)
    assert all(u.meta[MERGE] == INLINE for a, _ in homes(inline) for u in a.nodes if u.meta.get(MERGE))
    # beside (the default), a product whose input the CPU makes has a task of its own
    assert beside.by_kind("shadow") and any(a is not b for a, b in homes(beside))
    assert [s.linears for s in inline.by_kind("npu")] == [s.linears for s in beside.by_kind("npu")]


def test_why_names_a_reason_for_every_node_on_the_cpu(llama, exported):
    p = _cut(llama, exported, "attention-half", shadowed=["model.layers.0.mlp.down_proj"])
    on_cpu = {n.name for s in p.subgraphs if s.processor == "cpu" for n in s.nodes if n.op == "call_function"}
    assert on_cpu <= set(p.why)
    assert set(p.why) <= {n.name for s in p.subgraphs if s.processor == "cpu" for n in s.nodes}
    reasons = " ".join(p.why.values())
    for expected in ("shadow product", "act, not on the NPU in placement attention-half",
                     "residual, not on the NPU", "outside the decoder blocks"):
        assert expected in reasons
    assert not any(r.startswith("attention") for r in p.why.values())


def test_a_placement_is_a_preset_or_pieces_and_nothing_else():
    assert parse_placement("attention+rope+norms").name == "attention-half"
    assert parse_placement("attention").pieces == {"attention"}       # a piece alone
    assert parse_placement("block").pieces == frozenset(PIECES) - {"peak"}
    assert parse_placement("fused").pieces == frozenset(PIECES)
    assert parse_placement("peak+rope+attention+norms").name == "attention+norms+rope+peak"
    assert parse_placement("act+rope").name == "rope+act"
    for bad in ("gpu", "attention+softmax", "", "inline", "paper+norms"):
        with pytest.raises(LlmNpuError, match="placement"):
            parse_placement(bad)
    assert parse_placement("inline+attention+norms+rope").name == "attention-half+inline"
    with pytest.raises(LlmNpuError, match=r"^placement block\+inline: its shadow products merge on the NPU"):
        parse_placement("block+inline")


def _linear_named(partition, suffix, layer=0):
    return next(n for n in partition.graph_module.graph.nodes if is_linear(n) and layer_of(n) == layer
                and n.meta.get("nn_module_stack") and list(n.meta["nn_module_stack"].values())[-1][0].endswith(suffix))


def test_peak_keeps_the_norm_readers_products_and_outputs_inside_their_graphs(llama, exported):
    layers = llama.model.config.num_hidden_layers
    every = list(quantizable_linears(llama.model))
    fused = _cut(llama, exported, "fused", shadowed=every)
    block = _cut(llama, exported, "block", shadowed=every)
    # q/k/v and gate/up read a norm: their products are peak markers in their own NPU graph, their adds
    # too; o_proj's and down_proj's inputs do not, and their products stay CPU shadow subgraphs
    peaks = [n for s in fused.by_kind("npu") for n in s.nodes if n.target is peak_delta]
    assert sorted(n.args[1].rsplit(".", 1)[-1] for n in peaks) == sorted(
        ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"] * layers)
    assert all(n.meta.get(PEAK) and all(u.meta.get(PEAK) for u in n.users) for n in peaks)
    cpu_products = sorted(p.rsplit(".", 1)[-1] for s in fused.by_kind("shadow") for p in s.linears)
    assert cpu_products == sorted(["o_proj", "down_proj"] * layers)
    graph_of = {n: s.index for s in fused.subgraphs for n in s.nodes}
    for suffix, inside in (("q_proj", True), ("gate_proj", True), ("o_proj", False), ("down_proj", False)):
        lin = _linear_named(fused, suffix)
        assert all((graph_of[u] == graph_of[lin]) == inside for u in lin.users if u in graph_of), suffix
    # per block: norm -> q/k/v -> RoPE -> attention -> o_proj (its input handed to the CPU's product
    # as the graph goes on); o_proj's merge -> residual add -> norm -> gate/up -> act -> down. Under
    # `block` every linear's output and each of o_proj's and down_proj's inputs end a graph too. The
    # last down_proj's merge and residual add make one more
    assert len(fused.by_kind("npu")) == 2 * layers + 1
    assert len(block.by_kind("npu")) > 2 * len(fused.by_kind("npu"))
    # without peak, the same placement's views read by a CPU product are made on the CPU, as before
    rest = "+".join(p for p in PIECES if p != "peak")
    assert len(_cut(llama, exported, rest, shadowed=every).by_kind("npu")) == len(block.by_kind("npu"))


# ------------------------------------------------------------------ backends' capability tables
def test_each_backend_declares_the_pieces_it_runs():
    qnn, cpu = backends.get("qnn"), backends.get("cpu-int8")
    every = ["paper", "paper+inline", "norms", "norms+inline", "attention-half", "attention-half+inline", "block"]
    assert set(cpu.pieces) == set(PIECES) and backends.placements(cpu) == every + ["fused"]
    # HTP runs every piece (what a QNN program writes of them is export's to say: test below)
    assert set(qnn.pieces) == set(PIECES) and backends.placements(qnn) == every + ["fused"]
    for b in (qnn, cpu):
        assert backends.check_placement(b, "block").name == "block"
        assert backends.check_placement(b, "fused").name == "fused"

    class LinearsOnly:      # a backend whose graphs hold INT8 linears only
        name, pieces, missing = "linears-only", {}, "its graphs are INT8 GEMMs"
    with pytest.raises(LlmNpuError, match=r"linears-only cannot run attention or norms on its NPU \(its graphs are "
                                          r"INT8 GEMMs\): use placement paper, paper\+inline$"):
        backends.check_placement(LinearsOnly, "attention+norms")
    assert backends.placements(LinearsOnly) == ["paper", "paper+inline"]
    with pytest.raises(LlmNpuError, match="unknown placement"):
        EngineConfig(CHUNK, placement="npu")
    assert EngineConfig(CHUNK, placement="norms+attention+rope").placement == "attention-half"


# ------------------------------------------------------------------ the phone model's pricing
@pytest.fixture(scope="module")
def block():
    return prepare("random:tiny-llama", 8, placement="block", progress=False, plan={})


def test_attention_on_the_npu_costs_its_fixed_window_at_16_bit_activations(block):
    dev = toy_device(**{"npu.vector_elems_per_s": 1e7})
    window = 48
    heads, kv_heads, d, layers, c = 4, 2, 16, 2, 8
    subs = block.partition.by_kind("npu")
    parts = [{k: sum(cost.npu_parts(s, past, dev, window=window)[k] for s in subs) for k in cost.npu_parts(subs[0], 0, dev)}
             for past in (0, 8, 40)]
    assert parts[0] == parts[1] == parts[2]              # static graphs: the window, whatever the past
    p = parts[0]
    assert p["attention"] == pytest.approx(layers * 4 * c * window * heads * d / matrix_ops_per_s(dev, "a16"))
    assert p["softmax"] == pytest.approx(layers * c * window * heads / 1e7)
    assert p["kv_read"] == pytest.approx(layers * 2 * window * kv_heads * d * 2 / 1e8)   # 16-bit K/V from DRAM
    # each piece's output once on the vector unit: per block two norms, two residual adds (h each),
    # RoPE of q and k, the new K and V written, the gated product (ffn); the final norm stays on the CPU
    h, ffn = 64, 128
    per_block = 4 * h + (heads + kv_heads) * d + 2 * kv_heads * d + ffn
    assert p["elementwise"] == pytest.approx(layers * c * per_block / 1e7)


def test_the_cpu_lane_empties_as_pieces_move_and_attention_leaves_it(block):
    paper = prepare("random:tiny-llama", 8, placement="paper", progress=False, plan={})
    a = simulate_prefill(paper, "SM8750", 64, ("ooo",))
    b = simulate_prefill(block, "SM8750", 64, ("ooo",))
    assert a["lanes"]["cpu"]["attention"] > 0 and "attention" not in b["lanes"]["cpu"]
    assert b["lanes"]["npu"]["attention"] > 0 and a["lanes"]["npu"]["attention"] == 0
    assert b["policies"]["ooo"]["cpu_busy_s"] < a["policies"]["ooo"]["cpu_busy_s"]


def test_a_shadow_merged_on_the_npu_is_priced_as_its_product_the_graphs_already_split():
    names = [n for n in quantizable_linears(load_model("random:tiny-llama").model) if "down_proj" in n]
    scn = prepare("random:tiny-llama", 8, placement="block", progress=False, plan={n: 0.01 for n in names})
    none = with_shadowed(scn, {})
    # the merge reads the linear's output, which ends an NPU graph with or without the path
    assert len(none.partition.by_kind("npu")) == len(scn.partition.by_kind("npu"))
    merges = [n for s in scn.partition.by_kind("npu") for n in s.nodes if n.meta.get(MERGE)]
    assert len(merges) == len(names)
    prices = soc_shadow_prices(scn, "SM8750", 64)
    assert set(prices.seconds) == set(names)
    # each path's price is its product's, as under the paper's split
    paper = soc_shadow_prices(prepare("random:tiny-llama", 8, placement="paper", progress=False,
                                      plan={n: 0.01 for n in names}), "SM8750", 64)
    assert all(prices.seconds[n] == pytest.approx(paper.seconds[n]) and paper.seconds[n] > 0 for n in names)
    assert prices.makespan(frozenset(names)) != prices.makespan(frozenset())     # the makespan sees the paths


def test_a_peak_product_is_priced_as_two_16_bit_gemms_and_is_never_the_cpus_to_prune():
    names = [n for n in quantizable_linears(load_model("random:tiny-llama").model) if "lm_head" not in n]
    scn = prepare("random:tiny-llama", 8, placement="fused", progress=False, plan={n: 0.01 for n in names})
    dev = toy_device(**{"npu.vector_elems_per_s": 1e7})
    c, h, ffn, heads, kv_heads, d, layers = 8, 64, 128, 4, 2, 16, 2
    got = sum(cost.npu_parts(s, 0, dev)["peak"] for s in scn.partition.by_kind("npu"))
    # per block q, k, v and gate, up: a [c, h] x [h, 32] one-hot pick and a [c, 32] x [32, n] product on
    # the 16-bit matrix rate; the c x h residues on the vector unit once for q/k/v, once for gate/up
    outs = [heads * d, kv_heads * d, kv_heads * d, ffn, ffn]
    want = layers * (sum(2.0 * c * cost.PEAK_CHANNELS * (h + n) / matrix_ops_per_s(dev, "a16") for n in outs)
                     + 2 * c * h / 1e7)
    assert got == pytest.approx(want) and got > 0
    # the automatic pruning prices o_proj's and down_proj's CPU products only, and always keeps the peaks
    prices = soc_shadow_prices(scn, "SM8750", 64)
    assert sorted(n.rsplit(".", 1)[-1] for n in prices.seconds) == sorted(["o_proj", "down_proj"] * layers)
    cpu_only = with_shadowed(scn, {n: v for n, v in scn.outlier_rate.items() if n not in prices.seconds})
    assert sum(n.target is peak_delta for s in cpu_only.partition.subgraphs for n in s.nodes) == 5 * layers
    assert prices.makespan(frozenset()) > 0


def test_an_inline_merge_costs_the_phone_nothing_beyond_its_product():
    names = [n for n in quantizable_linears(load_model("random:tiny-llama").model) if "lm_head" not in n]
    plan = {n: 0.01 for n in names}
    beside = prepare("random:tiny-llama", 8, placement="paper", progress=False, plan=plan)
    inline = prepare("random:tiny-llama", 8, placement="paper+inline", progress=False, plan=plan)
    dev = toy_device()
    merges = [n for s in beside.partition.subgraphs for n in s.nodes if n.meta.get(MERGE)]
    assert len(merges) == len(names)
    adds = sum(cost.cpu_node_seconds(n, 0, dev, plan) for n in merges)
    assert adds > 0
    a = sum(cost.cpu_seconds(s, 0, dev, plan) for s in beside.partition.subgraphs if s.processor == "cpu")
    b = sum(cost.cpu_seconds(s, 0, dev, plan) for s in inline.partition.subgraphs if s.processor == "cpu")
    assert b == pytest.approx(a - adds)         # the same ops, less the adds of the products


def test_the_chosen_placement_is_the_fastest_simulated(monkeypatch):
    scn, rows = choose_placement("random:tiny-llama", 8, "SM8750", 64, ["paper", "attention-half", "block"],
                                 pruning_rate=0.0, progress=False)
    assert [r["placement"] for r in rows] and scn.partition.placement.name == rows[0]["placement"]
    for r in rows:
        alone = prepare("random:tiny-llama", 8, pruning_rate=0.0, placement=r["placement"], progress=False,
                        soc="SM8750")
        assert simulate_prefill(alone, "SM8750", 64, ("ooo",))["policies"]["ooo"]["wall_s"] == pytest.approx(r["wall_s"])
    assert rows == sorted(rows, key=lambda r: r["wall_s"])
    # priced as the program the export writes (16-bit residual writers: test_simulate.py prices them)
    from llmnpu_delegate.simulate import phone
    priced, simulate_as = [], phone.simulate_prefill
    monkeypatch.setattr(phone, "simulate_prefill", lambda *a, **k: priced.append(k["program"].name) or simulate_as(*a, **k))
    choose_placement("random:tiny-llama", 8, "SM8750", 64, ["paper", "block"], pruning_rate=0.0, progress=False,
                     program=get_program("ours-r16"))
    assert priced == ["ours-r16", "ours-r16"]


# ------------------------------------------------------------------ the CLI
def test_partition_cli_places_and_explains(capsys):
    assert main(["partition", "--model", "random:tiny-llama", "--chunk", "16", "--quant", "fp32", "--no-progress",
                 "--placement", "attention", "--why", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["placement"] == "attention" and out["why"]
    assert not any(r.startswith("attention") for r in out["why"].values())
    with pytest.raises(SystemExit, match="2"):
        main(["partition", "--model", "random:tiny-llama", "--placement", "gpu"])
    assert "unknown placement 'gpu'" in capsys.readouterr().err


def test_simulate_cli_chooses_a_placement_and_takes_a_forced_one(capsys):
    args = ["simulate", "--model", "random:tiny-llama", "--soc", "SM8750", "--prompt-len", "32", "--chunk", "8",
            "--pruning-rate", "0", "--policies", "ooo", "--no-progress"]
    assert main(args + ["--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    tried = {r["placement"] for r in auto["placement_choice"]}
    assert tried == set(backends.placements(backends.get("qnn")))
    best = min(auto["placement_choice"], key=lambda r: r["wall_s"])
    assert auto["placement"] == best["placement"]
    assert math.isclose(auto["policies"]["ooo"]["wall_s"], best["wall_s"], rel_tol=1e-9)
    assert main(args + ["--placement", "paper"]) == 0
    text = capsys.readouterr().out
    assert "placement paper" in text and "placement chosen" not in text
    assert main(args + ["--program", "paper", "--placement", "block"]) == 2


# ------------------------------------------------------------------ the engine's stand-in NPU
@pytest.fixture(scope="module")
def engine(llama):
    """tiny-llama's engine by (placement, quantization, NPU K/V bits), built once: chunk 64 with a
    16-row tail, every shadow path kept."""
    from llmnpu_delegate.quantize import quant_config
    from llmnpu_delegate.runtime.engine import Prefiller
    built = {}

    def get(placement, quant, kv_bits=16):
        key = (placement, quant, kv_bits)
        if key not in built:
            q = quant_config(quant, 0.0) if quant != "fp32" else None
            built[key] = Prefiller(llama, 64, quant=q, placement=placement, progress=False, npu_kv_bits=kv_bits)
        return built[key]
    return get


@pytest.fixture(scope="module")
def prompt(llama):
    return torch.randint(0, llama.model.config.vocab_size, (1, 140), generator=torch.Generator().manual_seed(1))


def _npu_graph_ops(engine) -> set[str]:
    return {str(n.target) for s in engine.program.steps if s.sub.kind == "npu" and isinstance(s.fn, torch.fx.GraphModule)
            for n in s.fn.graph.nodes}


@pytest.mark.parametrize("placement, quant", [("rope+residual+act", "w8a8-shadow"), ("attention-half", "fp32"),
                                               ("block", "fp32")])
def test_the_engine_runs_a_placement_with_the_papers_numbers_on_the_npu_lane(engine, prompt, placement, quant):
    want, got = engine("paper", quant)(prompt), engine(placement, quant)(prompt)
    assert got.rows == want.rows == 2 * 64 + 16             # the last 12 tokens ran as the 16-row tail
    # the same ops on the CPU's kernels: only the lane that runs them differs. In float, measured:
    # attention-half equal, block 1.8e-7 of the range (a float32 rounding: a float region's
    # rewrites inside one graph need not pick the forms they pick across two)
    for a, b in zip([got.logits, *got.past_k, *got.past_v], [want.logits, *want.past_k, *want.past_v]):
        if quant == "fp32":
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6 * float(b.abs().max()))
        else:
            assert torch.equal(a, b)
    # the piece's op, as the CPU's rewrites leave it (fuse.py: silu_mul_)
    moved = {"rope+residual+act": "silu", "attention-half": "attention", "block": "silu"}[placement]
    assert any(moved in t for t in _npu_graph_ops(engine(placement, quant)))
    assert all(isinstance(s.fn, nn.Module) and not isinstance(s.fn, torch.fx.GraphModule)
               for s in engine("paper", quant).program.steps if s.sub.kind == "npu")     # linears-only regions


@pytest.mark.parametrize("base", ["paper", "norms"])
def test_the_engine_runs_inline_shadow_products_merged_in_place_with_the_same_numbers(engine, prompt, base):
    want, got = engine(base, "w8a8-shadow")(prompt), engine(f"{base}+inline", "w8a8-shadow")(prompt)
    for a, b in zip([got.logits, *got.past_k, *got.past_v], [want.logits, *want.past_k, *want.past_v]):
        assert torch.equal(a, b)        # the product summed apart, then added once: the same bits
    # fewer or as many: a chunk whose last layer's queries no one reads (its successor needs its K/V
    # only) skips their product inline, where beside it ran with k and v's in one task
    assert 0 < got.outlier_elements <= want.outlier_elements
    inline = engine(f"{base}+inline", "w8a8-shadow").program
    products = [n for s in inline.steps if isinstance(s.fn, torch.fx.GraphModule) for n in s.fn.graph.nodes
                if n.op == "call_module" and isinstance(s.fn.get_submodule(n.target), ShadowDelta)]
    assert products and all("into" in n.kwargs for n in products)      # runtime/fuse.py merged every one
    assert len(inline.steps) < len(engine(base, "w8a8-shadow").program.steps)


def test_quantized_attention_on_the_npu_lane_runs_at_its_encodings(engine, prompt, llama):
    from llmnpu_delegate.kernels.npu_attention import NpuAttention
    layers = llama.model.config.num_hidden_layers
    for bits in (16, 8):
        modules = [m for s in engine("block", "w8a8-shadow", bits).program.steps if s.sub.kind == "npu"
                   for m in s.fn.modules() if isinstance(m, NpuAttention)]
        assert len(modules) == layers and all(m.enc.k.bits == m.enc.v.bits == bits for m in modules)
        assert all(m.enc.q.bits == m.enc.scores.bits == m.enc.out.bits == 16 for m in modules)
    ref = engine("paper", "fp32")(prompt).logits
    paper = engine("paper", "w8a8-shadow")(prompt).logits
    npu16, npu8 = (engine("block", "w8a8-shadow", b)(prompt).logits for b in (16, 8))
    assert not torch.equal(npu16, paper) and not torch.equal(npu16, npu8)

    def sqnr(x):
        return float(10 * torch.log10(ref.pow(2).sum() / (x - ref).pow(2).sum()))
    # measured on tiny-llama: paper 45.7 dB, 16-bit attention 45.6, 8-bit window 44.1
    assert sqnr(npu16) > sqnr(paper) - 1.0
    assert sqnr(npu8) > sqnr(paper) - 3.0


def test_the_engine_runs_the_peak_products_as_the_harness_scores_them():
    """Under ``fused`` the engine's NPU graphs multiply q/k/v's and gate/up's peak channels themselves
    (``PeakProduct`` over the plan's static set), and its logits are the harness's numerics of the
    placement (``placed_numerics``: the same sets, attention and norms at the same encodings) within a
    tenth of what the restriction changes against ``block``. Outliers on 40 of each input norm's 64
    channels: more than 32 peak channels can hold, so the restriction shows."""
    from conftest import assert_within_quant_effect, inject_outliers

    from llmnpu_delegate.backends.cpu_int8 import PeakProduct
    from llmnpu_delegate.backends.graph_cache import GraphCache
    from llmnpu_delegate.evaluate import quantized_model
    from llmnpu_delegate.models import fingerprint
    from llmnpu_delegate.placed_numerics import apply_placement
    from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate
    from llmnpu_delegate.runtime.engine import Prefiller

    lm = load_model("random:tiny-llama")
    inject_outliers(lm.model, scale=8.0, channels=tuple(range(40)))
    lm.fingerprint = fingerprint(lm.model)
    calib = calibrate(lm.model, torch.randint(0, 1000, (256,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    quant = QuantConfig(outliers="shadow", pruning_rate=0.0)
    ids = torch.randint(0, 1000, (100,), generator=torch.Generator().manual_seed(5))

    def engine(placement):
        return Prefiller(lm, 32, quant=quant, calibration=calib, cache=GraphCache(), progress=False,
                         attention="fp32", placement=placement)

    fused = engine("fused")
    peaks = [m for s in fused.program.steps if s.sub.kind == "npu" for m in s.fn.modules() if isinstance(m, PeakProduct)]
    assert sorted({m.name.rsplit(".", 1)[-1] for m in peaks}) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert len(peaks) == 5 * lm.model.config.num_hidden_layers and all(0 < len(m.channels) <= 32 for m in peaks)
    got = F.log_softmax(fused(ids).logits.float(), -1)
    block = F.log_softmax(engine("block")(ids).logits.float(), -1)
    model, _ = quantized_model(lm, quant, calib, progress=False)
    apply_placement(lm, model, "fused", 16, 32, calib)
    with torch.inference_mode():
        scored = F.log_softmax(model(input_ids=ids[None]).logits[0, -1].float(), -1)
    err, effect = assert_within_quant_effect(scored, got.reshape(scored.shape), block.reshape(scored.shape))
    print(f"peak products: harness {err:.2e} from the engine, the restriction's effect {effect:.2e}")


def test_quantized_norms_on_the_npu_lane_run_at_their_encodings(engine, prompt, llama):
    """Under ``norms`` every block norm of a quantized engine runs in an NPU graph at its calibrated
    16-bit encodings (``kernels/npu_norm.py``), as HTP's RmsNorm computes it; the float engine keeps
    float norms there (same bits as the paper's split)."""
    from llmnpu_delegate.kernels.npu_norm import NpuNorm
    from llmnpu_delegate.prepare import norm_modules

    norms = {name: m for s in engine("norms", "w8a8-shadow").program.steps if s.sub.kind == "npu"
             for name, m in s.fn.named_modules() if isinstance(m, NpuNorm)}
    assert sorted(norms) == sorted(f"norm_{layer}_{name}" for layer, name in norm_modules(llama.model))
    assert all(m.enc.x.bits == m.enc.weight.bits == m.enc.out.bits == 16 for m in norms.values())
    assert not any(isinstance(m, NpuNorm) for s in engine("norms", "fp32").program.steps if s.sub.kind == "npu"
                   for m in s.fn.modules())
    ref = engine("paper", "fp32")(prompt)
    paper, npu = engine("paper", "w8a8-shadow")(prompt), engine("norms", "w8a8-shadow")(prompt)
    assert not torch.equal(npu.logits, paper.logits)

    def sqnr(x):
        return float(10 * torch.log10(ref.logits.pow(2).sum() / (x - ref.logits).pow(2).sum()))
    # the 16-bit grids cost little beside the INT8 linears' error (measured on tiny-llama against the
    # float engine: paper 44.8 dB, norms 44.9)
    assert sqnr(npu.logits) > sqnr(paper.logits) - 1.0
    # ...and the rounding is the graphs' NpuNorm modules': with their input and output grids 256 times
    # coarser (8 bits), the engine loses more (measured: 40.1 dB, 4.8 lower)
    coarse = {name: NpuNorm(dataclasses.replace(m.enc, x=_coarser(m.enc.x), out=_coarser(m.enc.out)))
              for name, m in norms.items()}
    with _swapped(engine("norms", "w8a8-shadow"), coarse):
        worse = engine("norms", "w8a8-shadow")(prompt)
    assert sqnr(worse.logits) < sqnr(npu.logits) - 3.0


def _coarser(enc):
    from llmnpu_delegate.kernels.npu_attention import Encoding

    return Encoding(enc.scale * 256, enc.zero // 256, 8)


@contextlib.contextmanager
def _swapped(engine, modules: dict):
    steps = [s for p in (engine.program, engine.tail) if p is not None for s in p.steps
             if s.sub.kind == "npu" and isinstance(s.fn, torch.fx.GraphModule)]
    old = {}
    for s in steps:
        for name, m in list(s.fn.named_children()):
            if name in modules:
                old[(id(s), name)] = m
                setattr(s.fn, name, modules[name])
    try:
        yield
    finally:
        for s in steps:
            for name in modules:
                if (id(s), name) in old:
                    setattr(s.fn, name, old[(id(s), name)])


def test_bench_times_the_engine_under_a_placement(capsys):
    args = ["bench", "--model", "random:tiny-llama", "--prompt-len", "40", "--chunk", "16", "--repeats", "1",
            "--quant", "fp32", "--policies", "ooo", "--no-progress"]
    assert main(args + ["--placement", "block", "--json"]) == 0
    block = json.loads(capsys.readouterr().out)
    assert main(args + ["--json"]) == 0
    paper = json.loads(capsys.readouterr().out)
    assert (block["placement"], paper["placement"]) == ("block", "paper")
    assert main(args + ["--placement", "norms"]) == 0
    assert "placement norms" in capsys.readouterr().out


# ------------------------------------------------------------------ the host's own choice
def test_the_host_keeps_the_papers_split_unless_another_is_clearly_faster():
    from llmnpu_delegate.runtime.engine import PLACEMENT_MARGIN, fastest_placement
    assert PLACEMENT_MARGIN == 0.10
    assert fastest_placement({"paper": 1.0, "norms": 0.95, "block": 0.91}) == "paper"    # inside the margin
    assert fastest_placement({"paper": 1.0, "norms": 0.95, "block": 0.85}) == "block"
    assert fastest_placement({"paper": 1.0, "block": 1.3}) == "paper"
    assert fastest_placement({"norms": 1.0, "block": 0.99}) == "block"    # without the paper's: the fastest
    # an inline form and its base compute the same bits: the faster stands for both, without a margin
    assert fastest_placement({"paper": 1.0, "paper+inline": 0.97, "norms": 0.95}) == "paper+inline"
    assert fastest_placement({"paper": 0.97, "paper+inline": 1.0, "norms": 0.95}) == "paper"
    assert fastest_placement({"paper": 1.0, "paper+inline": 0.95, "norms+inline": 0.84}) == "norms+inline"
    assert fastest_placement({"paper": 1.0, "paper+inline": 0.9, "norms+inline": 0.84}) == "paper+inline"


def test_auto_placement_times_each_preset_once_keeps_its_choice_and_runs_it(llama, engine, prompt, tmp_path,
                                                                             monkeypatch):
    import dataclasses

    from llmnpu_delegate.prepare import default_calibration
    from llmnpu_delegate.quantize import Calibration, quant_config
    from llmnpu_delegate.runtime.engine import Prefiller, host_placement_choice, placement_key
    calib = Calibration.load(default_calibration(llama, False).path)
    calib.save(tmp_path / "calib.pt")               # a copy: the session's artefact stays as it was
    quant = quant_config("w8a8-shadow", 0.0)
    config = EngineConfig(64, quant=quant, placement="auto")
    seconds = {"paper": 1.0, "paper+inline": 0.9, "norms": 0.97, "norms+inline": 0.95, "attention-half": 1.4,
               "attention-half+inline": 1.3, "block": 0.8}
    timed = []

    def measure(trial):
        timed.append(trial.config.placement)
        assert trial.quant == quant and trial.chunk_len == 64
        return seconds[trial.config.placement]
    choice = host_placement_choice(llama, calib, config, progress=False, measure=measure)
    # each once, then the final: the fastest against the paper's faster form, again
    assert sorted(timed[:-2]) == sorted(seconds) and timed[-2:] == ["paper+inline", "block"]
    assert choice == {"placement": "block", "prefill_s": seconds}
    # kept with the calibration on disk: an engine made from it times nothing and runs the choice
    monkeypatch.setattr(Prefiller, "timed_prefill", lambda self, *a: pytest.fail("timed again"))
    chosen = Prefiller(llama, 64, quant=quant, calibration=Calibration.load(tmp_path / "calib.pt"),
                       placement="auto", progress=False)
    assert chosen.config.placement == "block" and chosen.placement_choice == choice
    want, got = engine("block", "w8a8-shadow")(prompt), chosen(prompt)
    assert torch.equal(got.logits, want.logits)
    # the choice holds for its settings only: another chunk length or pruning is chosen anew
    others = [dataclasses.replace(config, chunk_len=32), dataclasses.replace(config, quant=quant_config("w8a8-shadow", 0.5)),
              dataclasses.replace(config, npu_kv_bits=8)]
    keys = {placement_key(c, calib) for c in [config, *others]}
    assert len(keys) == 4
    # the float reference has nothing to place
    assert host_placement_choice(llama, None, EngineConfig(64, quant=None, placement="auto"))["placement"] == "paper"


def test_auto_placement_decides_on_the_final_timing(llama, tmp_path):
    """A placement that looked fastest in its own pair but not beside the paper's, timed again in
    turn, is not chosen: the final's times replace the first ones."""
    from llmnpu_delegate.prepare import default_calibration
    from llmnpu_delegate.quantize import Calibration, quant_config
    from llmnpu_delegate.runtime.engine import host_placement_choice
    calib = Calibration.load(default_calibration(llama, False).path)
    calib.save(tmp_path / "calib.pt")
    first = {"paper": 1.0, "paper+inline": 0.9, "norms": 0.97, "norms+inline": 0.95, "attention-half": 1.4,
             "attention-half+inline": 1.3, "block": 0.7}
    final = {"paper+inline": 0.92, "block": 0.88}        # within the margin of the paper's form
    timed = []

    def measure(trial):
        name = trial.config.placement
        timed.append(name)
        return final[name] if timed.count(name) == 2 else first[name]
    config = EngineConfig(64, quant=quant_config("w8a8-shadow", 0.0), placement="auto")
    choice = host_placement_choice(llama, calib, config, progress=False, measure=measure)
    assert timed[-2:] == ["paper+inline", "block"]
    assert choice == {"placement": "paper+inline", "prefill_s": {**first, **final}}


def test_auto_placement_leaves_out_norms_a_model_cannot_put_on_the_npu(tmp_path):
    """Gemma's norms scale by (1 + w): no NPU form, so ``auto`` times only the placements without
    them, and a named one with them is refused in one line."""
    from llmnpu_delegate.prepare import default_calibration
    from llmnpu_delegate.quantize import Calibration, quant_config
    from llmnpu_delegate.runtime.engine import Prefiller, host_placement_choice
    gemma = load_model("random:tiny-gemma")
    calib = Calibration.load(default_calibration(gemma, False).path)
    calib.save(tmp_path / "calib.pt")
    timed = []

    def measure(trial):
        timed.append(trial.config.placement)
        return 1.0 if trial.config.placement.startswith("paper") else 0.5
    config = EngineConfig(64, quant=quant_config("w8a8-shadow", 0.0), placement="auto")
    choice = host_placement_choice(gemma, calib, config, progress=False, measure=measure)
    assert set(timed) == {"paper", "paper+inline"} and choice["placement"].startswith("paper")
    with pytest.raises(LlmNpuError, match=r"gemma's norms scale by \(1 \+ w\).*a placement without 'norms'"):
        Prefiller(gemma, 64, quant="w8a8", calibration=calib, placement="norms", progress=False)


def test_placements_timed_together_take_their_runs_in_turn():
    from types import SimpleNamespace

    from llmnpu_delegate.runtime.engine import PROFILE_RUNS, timed_together
    calls = []

    class Stub:
        def __init__(self, name, walls):
            self.name, self.walls, self.last_run = name, iter(walls), None

        def _timing_ids(self, n):
            return torch.zeros(n, dtype=torch.long)

        def __call__(self, ids, policy):
            assert policy == "ooo" and ids.numel() == 10
            calls.append(self.name)
            self.last_run = SimpleNamespace(wall_s=next(self.walls))
    a, b = Stub("a", [9.0, 1.0, 2.0, 3.0, 4.0][:PROFILE_RUNS + 1]), Stub("b", [9.0, 5.0, 6.0, 7.0, 8.0][:PROFILE_RUNS + 1])
    got = timed_together([a, b], 10)
    assert calls == ["a", "b"] * (PROFILE_RUNS + 1)         # in turn, the first run of each a warm-up
    assert got == [float(torch.tensor([1.0, 2.0, 3.0, 4.0][:PROFILE_RUNS]).median()),
                   float(torch.tensor([5.0, 6.0, 7.0, 8.0][:PROFILE_RUNS]).median())]


def test_the_choice_times_a_whole_prefill_out_of_order(engine):
    e = engine("paper", "w8a8-shadow")
    assert e.timed_prefill(100) > 0                   # what it takes is the schedule's own wall time
    assert e.last_run.policy == "ooo" and e.last_run.wall_s > 0 and len(e.last_run.records) > 0


def test_a_malformed_placement_choice_in_the_calibration_is_a_one_line_error(llama, tmp_path):
    from llmnpu_delegate.prepare import default_calibration
    from llmnpu_delegate.quantize import Calibration
    calib = Calibration.load(default_calibration(llama, False).path)
    calib.placement["k"] = {"placement": "block", "prefill_s": {"block": "fast"}}
    calib.save(tmp_path / "calib.pt")
    with pytest.raises(LlmNpuError, match=r"malformed .*prefill_s\[block\].*delete it and recalibrate"):
        Calibration.load(tmp_path / "calib.pt")


def test_export_refuses_a_placement_its_backend_cannot_write_before_loading_a_model(capsys, tmp_path):
    out = tmp_path / "x.pte"
    peak = "writes the peak products in the norms' graphs of a qnn program beside float attention"
    for extra, why in ((["--backend", "qnn", "--placement", "block"], "on qnn, the norms, RoPE and attention"),
                       (["--backend", "cpu-int8", "--placement", "norms", "--output-bits", "8"], "float outputs only"),
                       (["--backend", "cpu-int8", "--placement", "fused", "--output-bits", "8"], peak),
                       (["--backend", "qnn", "--placement", "fused"], peak),
                       (["--backend", "cpu-int8", "--placement", "sideways"], "unknown placement 'sideways'")):
        assert main(["export", "--model", "random:tiny-llama", "--out", str(out), *extra]) == 2
        err = capsys.readouterr().err
        assert why in err and err.count("\n") == 1, err
    assert not any(tmp_path.iterdir())


def test_a_qnn_export_chooses_among_what_its_program_holds_by_the_phone_model():
    """``--placement auto`` (qnn's default): the phone model's prediction for each placement a QNN
    program holds, the fastest chosen; the paper's split for cpu-int8 unless named; a model whose
    norms or attention a QNN program cannot hold leaves out the placements that would. Every shadow
    path kept: the automatic pruning, chosen once per placement, is tested on its own (test_simulate)
    and would cost minutes here."""
    import argparse

    from llmnpu_delegate.cli.export import program_placement
    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.prepare import qnn_holds

    def args(model="random:tiny-llama", backend="qnn", placement=None):
        return argparse.Namespace(placement=placement, backend=backend, model=model, chunk=32, soc="SM8750",
                                  context=96, quant="w8a8-shadow", pruning_rate=0.0, no_progress=True)

    config = ExportConfig("qnn", "SM8750", 96)
    chosen, rows = program_placement(args(), config)
    assert {r["placement"] for r in rows} == {"paper", "norms", "attention-half"}
    assert chosen == rows[0]["placement"] and rows[0]["wall_s"] == min(r["wall_s"] for r in rows)
    # the prediction is the simulator's, as `llmnpu simulate --placement P` makes it
    for r in rows:
        scn = prepare("random:tiny-llama", 32, pruning_rate=0.0, placement=r["placement"], progress=False, soc="SM8750")
        assert simulate_prefill(scn, "SM8750", 96, ("ooo",))["policies"]["ooo"]["wall_s"] == pytest.approx(r["wall_s"])
    assert program_placement(args(placement="paper"), config) == ("paper", [])
    assert program_placement(args(backend="cpu-int8"), ExportConfig("cpu-int8", None, 96)) == ("paper", [])
    # Gemma 2: norms without an NPU form, softcapped attention: nothing to choose
    assert program_placement(args(model="random:tiny-gemma2"), config) == ("paper", [])
    # Qwen3: a q/k norm sits between its linear and RoPE, so only an attention region holds it
    qwen3 = load_model("random:tiny-qwen3").model
    assert [p for p in ("paper", "norms", "attention-half") if qnn_holds(qwen3, p)] == ["paper", "attention-half"]


def test_the_phone_models_choice_is_kept_per_model_phone_and_settings(tmp_path, monkeypatch):
    """The automatic QNN placement's predictions are made once per model, SoC, prompt and settings:
    a second export reads them back, any other key computes its own, a damaged entry is made again."""
    import argparse
    import json

    from llmnpu_delegate.cli import export
    from llmnpu_delegate.lower.export_config import ExportConfig

    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    calls = []

    def predicted(model, chunk, soc, prompt_len, candidates, *rest, program):
        calls.append((soc, prompt_len, program.name))
        rows = [{"placement": p, "wall_s": 1.0 / (1 + i + len(calls)), "tok_s": 1.0} for i, p in enumerate(candidates)]
        return None, sorted(rows, key=lambda r: r["wall_s"])
    monkeypatch.setattr(export, "choose_placement", predicted)

    def choose(soc="SM8750", context=96, residual_bits=8):
        args = argparse.Namespace(placement=None, backend="qnn", model="random:tiny-llama", chunk=32, soc=soc,
                                  context=context, quant="w8a8-shadow", pruning_rate=None, no_progress=True)
        return export.program_placement(args, ExportConfig("qnn", soc, context, residual_bits=residual_bits))

    first = choose()
    assert len(calls) == 1 and first[0] == first[1][0]["placement"] == "attention-half"
    assert choose() == first and len(calls) == 1                  # read back, not predicted again
    assert choose(soc="SM8650") != first and len(calls) == 2      # another phone, another prompt: their own
    choose(context=64)
    assert len(calls) == 3 and {c[2] for c in calls} == {"ours"}
    choose(residual_bits=16)                                      # priced as the program it writes
    assert len(calls) == 4 and calls[-1] == ("SM8750", 96, "ours-r16")
    entries = list((tmp_path / "phone-placement").glob("*.json"))
    assert len(entries) == 4 and all(json.loads(e.read_text())["key"]["model"] for e in entries)
    for e in entries:
        e.write_text("{trunc")
    assert choose() != first and len(calls) == 5                  # damaged: predicted again
    assert choose() == choose() and len(calls) == 5


def test_run_prints_its_placement_and_a_program_refuses_one(capsys):
    args = ["run", "--model", "random:tiny-llama", "--prompt", "one two three", "--max-new-tokens", "2",
            "--chunk", "16", "--pruning-rate", "0", "--no-progress"]
    assert main(args + ["--placement", "norms"]) == 0
    assert "placement norms (NPU regions: the linears, norms)" in capsys.readouterr().out
    assert main(["run", "--pte", "x.pte", "--prompt", "hi", "--placement", "paper"]) == 2
    assert "drop --placement" in capsys.readouterr().err
