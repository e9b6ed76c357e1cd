"""The partitioner's core pass, its ExecuTorch face, and the partition report."""
import io
import json

import pytest
import torch

from llmnpu_delegate.chunk_step import example_inputs, export_chunk_step
from llmnpu_delegate.models import load_model
from llmnpu_delegate.partitioner import partition_graph
from llmnpu_delegate.partitioner.report import memory_report
from llmnpu_delegate.quantize import quantizable_linears

CHUNK = 16


@pytest.fixture(scope="module")
def llama():
    return load_model("random:tiny-llama")


@pytest.fixture(scope="module")
def exported(llama):
    return export_chunk_step(llama.model, CHUNK)


def _partition(llama, exported, **kw):
    return partition_graph(exported.module(), quantizable_linears(llama.model), prefix="model.", **kw)


def test_regions_group_linears_that_share_an_input(llama, exported):
    p = _partition(llama, exported)
    npu = p.by_kind("npu")
    layers = llama.model.config.num_hidden_layers
    assert len(npu) == 4 * layers
    short = [[n.rsplit(".", 1)[-1] for n in s.linears] for s in npu[:4]]
    assert short == [["q_proj", "k_proj", "v_proj"], ["o_proj"], ["gate_proj", "up_proj"], ["down_proj"]]
    assert all(s.static for s in npu)
    # every quantizable linear is in exactly one NPU region; lm_head is not
    names = [n for s in npu for n in s.linears]
    assert sorted(names) == sorted(quantizable_linears(llama.model))
    # subgraphs alternate processors: no two NPU subgraphs in a row (CPU float work between them)
    procs = [s.processor for s in p.subgraphs]
    assert all(not (a == b == "npu") for a, b in zip(procs, procs[1:]))


def test_attention_is_the_only_dynamic_work(llama, exported):
    p = _partition(llama, exported)
    layers = llama.model.config.num_hidden_layers
    dynamic = [s for s in p.subgraphs if not s.static]
    for s in dynamic:
        assert s.kind == "cpu"
        assert not any(n.op == "get_attr" for n in s.nodes), "a dynamic subgraph must hold no weights"
    attention = [s for s in dynamic if "llmnpu.chunk_attention.default" in {str(n.target) for n in s.nodes}]
    reads_past = [s for s in dynamic if any(i.startswith("past_") for i in s.inputs)]
    assert len(attention) == len(reads_past) == layers
    # layer l's attention reads layer l's past K/V only (no false cross-layer dependency)
    for layer, s in enumerate(reads_past):
        past = {i for i in s.inputs if i.startswith("past_")}
        assert past == {f"past_k_{layer}", f"past_v_{layer}"}
    # one subgraph per layer, but the last: its K/V are made apart from its attention product, which
    # only the logits need (so a chunk other than the last skips it), in the subgraph right after
    assert attention[:-1] == reads_past[:-1] and len(dynamic) == layers + 1
    kv, product = reads_past[-1], attention[-1]
    assert product.index == kv.index + 1 and set(kv.outputs) & set(product.inputs)
    assert not set(product.outputs) & set(p.graph_outputs)


def test_shadow_subgraphs_follow_the_plan(llama, exported):
    names = list(quantizable_linears(llama.model))
    shadowed = [n for n in names if n.endswith(("down_proj", "q_proj"))]
    p = _partition(llama, exported, shadowed=shadowed)
    shadow = p.by_kind("shadow")
    assert sorted(n for s in shadow for n in s.linears) == sorted(shadowed)
    assert all(s.processor == "cpu" for s in shadow)
    # a shadow subgraph reads the same float input as the NPU region next to it
    for s in shadow:
        region = next(r for r in p.by_kind("npu") if s.linears[0] in r.linears)
        assert s.inputs == region.inputs


def test_norm_policy_moves_norms_into_npu_regions(llama, exported):
    cpu = _partition(llama, exported, placement="paper")
    npu = _partition(llama, exported, placement="norms")
    assert len(npu.subgraphs) <= len(cpu.subgraphs)
    qkv = npu.by_kind("npu")[0]
    assert any("rsqrt" in str(n.target) for n in qkv.nodes)
    assert not any("rsqrt" in str(n.target) for s in cpu.by_kind("npu") for n in s.nodes)


def test_flop_share_matches_a_count_from_the_config(llama, exported):
    p = _partition(llama, exported)
    cfg = llama.model.config
    chunks = 4
    hd = cfg.hidden_size // cfg.num_attention_heads
    weights = sum(m.weight.numel() for m in quantizable_linears(llama.model).values())
    npu = 2 * weights * CHUNK * chunks
    head = 2 * cfg.vocab_size * cfg.hidden_size * chunks                 # one logits row per chunk
    attn = sum(4 * cfg.num_attention_heads * CHUNK * (i + 1) * CHUNK * hd for i in range(chunks))
    attn *= cfg.num_hidden_layers
    assert p.npu_flop_share(chunks, CHUNK) == pytest.approx(npu / (npu + head + attn))


def test_memory_report_counts_one_graph_set_per_position_for_naive(llama, exported):
    p = _partition(llama, exported)
    m = memory_report(p, CHUNK, 4 * CHUNK)
    assert m["chunks"] == 4
    assert m["naive_bytes"] == 4 * m["static_bytes"] + m["dynamic_bytes"]
    assert m["shared_bytes"] == m["static_bytes"] + m["dynamic_bytes"]
    assert 0.5 < m["saved"] < 0.75
    one = memory_report(p, CHUNK, CHUNK)
    assert one["saved"] == 0.0


def test_summary_and_cli(capsys):
    from llmnpu_delegate.cli import main

    assert main(["partition", "--model", "random:tiny-llama", "--chunk", "16", "--prompt-len", "64",
                 "--quant", "fp32", "--json", "--no-progress"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["kinds"]["npu"]["subgraphs"] == 8 and out["memory"]["chunks"] == 4
    assert main(["partition", "--model", "random:tiny-llama", "--chunk", "16", "--quant", "fp32", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "FLOPs on the NPU" in text and "saved" in text
    assert main(["partition", "--model", "random:tiny-llama", "--chunk", "0", "--quant", "fp32"]) == 2


def test_executorch_lowering_delegates_every_region(llama, exported):
    from executorch.exir import to_edge_transform_and_lower
    from executorch.exir.backend.partitioner import DelegationSpec
    from executorch.exir.lowered_backend_module import LoweredBackendModule

    from llmnpu_delegate.partitioner.executorch import (
        LlmNpuPartitioner,
        plan_compile_specs,
    )

    names = quantizable_linears(llama.model)
    scales = {n: 0.01 * (i + 1) for i, n in enumerate(names)}
    spec = DelegationSpec("LlmNpuPayloadBackend", plan_compile_specs(scales))
    edge = to_edge_transform_and_lower(exported, partitioner=[LlmNpuPartitioner(names, prefix="model.",
                                                                                delegation_spec=spec)])
    gm = edge.exported_program().graph_module
    lowered = [m for m in gm.modules() if isinstance(m, LoweredBackendModule)]
    assert len(lowered) == 4 * llama.model.config.num_hidden_layers
    # the payload holds the region's INT8 weights and the plan's activation scales
    payload = torch.load(io.BytesIO(lowered[0].processed_bytes), weights_only=True)
    entries = payload["linears"]
    assert [e["name"].rsplit(".", 1)[-1] for e in entries] == ["q_proj", "k_proj", "v_proj"]
    for e in entries:
        short = e["name"][len("model."):]
        w = names[short].weight
        assert e["w_q"].dtype == torch.int8 and e["act_scale"] == scales[short]
        torch.testing.assert_close(e["w_q"].float() * e["w_scale"][:, None], w, atol=w.abs().max().item() / 127, rtol=0)
    # the lowered program still computes the chunk step (delegates run their original graphs here)
    inputs = example_inputs(llama.model.config, CHUNK, 2 * CHUNK)
    inputs = (torch.randint(0, 1000, (1, CHUNK)),) + inputs[1:]
    want = exported.module()(*inputs)[0]
    torch.testing.assert_close(edge.exported_program().module()(*inputs)[0], want)
