"""Model families (``families.py``): every declaration matches the models it names, and the Qwen3
family, added through its declaration alone, runs at every level.

The other suites parametrize over the declared families' tiny shapes (``families.tiny_shapes``): the
float prefill against Hugging Face, chunked against unchunked (``test_prefill.py``), ``generate``
token for token (``test_hf.py``), the INT8 decoder against HF and the native step against the
Python loop (``test_decode.py``). What is Qwen3's own is here: its shapes, its q/k norms on the CPU
side of the partition, W8A8 and ``torch.compile``, the exported program in both runners, simulate.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.families import ENGINE_FAMILIES, family_of, tiny_shapes
from llmnpu_delegate.models import decoder_layers, load_model, model_skeleton, random_config
from llmnpu_delegate.quantize import CalibConfig, calibrate, quantizable_linears

QWEN3 = "random:tiny-qwen3"
CHUNK = 16


@pytest.mark.parametrize("shape", tiny_shapes())
def test_the_declaration_names_the_modules_of_its_models(shape):
    """Every declared linear and norm exists in the family's blocks, every quantizable linear has a
    role, and a family declares q/k norms exactly when its attention has them."""
    lm = load_model(f"random:{shape}")
    family = family_of(lm.model.config)
    block = decoder_layers(lm.model)[0]
    assert all(isinstance(block.get_submodule(n), nn.Linear) for n in family.linears)
    assert all(block.get_submodule(n).weight.dim() == 1 for n in family.norms + (family.qk_norm or ()))
    names = [n for n, _ in block.named_modules()]
    assert any(n.endswith(("q_norm", "k_norm")) for n in names) == (family.qk_norm is not None)
    linears = quantizable_linears(lm.model)
    assert sorted(n.split(".layers.0.")[1] for n in linears if ".layers.0." in n) == sorted(family.linears)
    assert all(family.role(n) in ("qkv", "o", "up", "down") for n in linears)


@pytest.mark.parametrize("shape", tiny_shapes())
def test_the_norm_readers_by_name_are_the_ones_the_partitioner_finds_in_the_graph(shape):
    """Piece ``peak`` keeps the shadow products of the linears that read a block norm inside their NPU
    graphs: the partitioner finds them by walking the traced chunk step back from each linear, the
    harness's numerics by the family's names. Both must name the same linears (and some, not all)."""
    from llmnpu_delegate.chunk_step import export_chunk_step
    from llmnpu_delegate.partitioner.regions import linear_names, reads_a_norm

    lm = load_model(f"random:{shape}")
    family = family_of(lm.model.config)
    quantizable = quantizable_linears(lm.model)
    graph = export_chunk_step(lm.model, CHUNK).module()
    in_graph = {name for node, name in linear_names(graph, quantizable, prefix="model.").items() if reads_a_norm(node)}
    by_name = {n for n in quantizable if family.reads_a_norm(n)}
    assert in_graph == by_name and 0 < len(by_name) < len(quantizable)


def test_unknown_families_are_refused_with_the_supported_list():
    with pytest.raises(LlmNpuError, match="unsupported architecture 'phi'.*qwen3"):
        family_of(random_config("phi-2"))        # declared for simulate only
    assert {"qwen3", "llama"} <= set(ENGINE_FAMILIES) and "phi" not in ENGINE_FAMILIES


@pytest.mark.parametrize("shape,billions", [("qwen3-0.6b", 0.60), ("qwen3-1.7b", 1.72)])
def test_qwen3_shapes_are_the_published_models(shape, billions):
    model = model_skeleton(f"random:{shape}")
    c = model.config
    assert c.head_dim == 128 and (c.head_dim * c.num_attention_heads != c.hidden_size) == (shape == "qwen3-0.6b")
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, rel=0.03)


@pytest.fixture(scope="module")
def qwen3():
    lm = load_model(QWEN3)
    ids = torch.randint(0, 1000, (4 * 64,), generator=torch.Generator().manual_seed(1))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    return lm, calib


def test_qwen3_q_k_norms_run_on_the_cpu_and_the_projections_on_the_npu(qwen3):
    from llmnpu_delegate.prepare import plan_and_partition

    lm, _ = qwen3
    _, partition = plan_and_partition(lm.model, lm, lm.fingerprint, CHUNK, None)
    npu = [s for s in partition.subgraphs if s.kind == "npu"]
    qkv = [s for s in npu if any(n.endswith("q_proj") for n in s.linears)]
    assert len(qkv) == 2 and all(len(s.linears) == 3 for s in qkv)       # q/k/v share their input
    norms = [n for s in partition.subgraphs if s.kind == "cpu" for n in s.nodes
             if "q_norm" in str(n.meta.get("nn_module_stack", "")) or "k_norm" in str(n.meta.get("nn_module_stack", ""))]
    assert norms and not [n for s in npu for n in s.nodes if n in norms]


def test_qwen3_w8a8_prefill_chunked_equals_unchunked_within_a_tenth_of_the_quantization_error(qwen3):
    from llmnpu_delegate.backends.graph_cache import GraphCache
    from llmnpu_delegate.quantize import QuantConfig
    from llmnpu_delegate.runtime.engine import Prefiller

    lm, calib = qwen3
    ids = torch.randint(0, 1000, (3 * CHUNK + 5,), generator=torch.Generator().manual_seed(2))
    quant = QuantConfig(outliers="shadow", pruning_rate=0.5)
    kw = dict(quant=quant, calibration=calib, cache=GraphCache(), progress=False, attention="fp32", policy="inorder")
    chunked, whole = Prefiller(lm, CHUNK, **kw)(ids), Prefiller(lm, 64, **kw)(ids)
    with torch.no_grad():
        fp32 = lm.model(ids[None]).logits[0, -1]
    error = (whole.logits - fp32).abs().max()
    assert error > 1e-3                                              # W8A8 is not float
    assert (chunked.logits - whole.logits).abs().max() < error / 10


def test_qwen3_through_torch_compile_equals_eager(qwen3):
    from llmnpu_delegate.compile import compile_options

    lm, _ = qwen3
    ids = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = lm.model(ids).logits
        got = torch.compile(lm.model, backend="llmnpu", options=compile_options(lm, quant="fp32"))(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.fixture(scope="module")
def qwen3_program(qwen3, tmp_path_factory):
    from llmnpu_delegate.lower.export_config import ExportConfig
    from llmnpu_delegate.lower.pte import export_pte
    from llmnpu_delegate.quantize import quant_config
    from llmnpu_delegate.runtime.engine import Prefiller

    lm, calib = qwen3
    engine = Prefiller(lm, CHUNK, quant=quant_config("w8a8-shadow", 0.5), calibration=calib, progress=False,
                       attention="fp32")
    out = tmp_path_factory.mktemp("qwen3") / "qwen3.pte"
    calib_ids = torch.randint(0, 1000, (3 * CHUNK,), generator=torch.Generator().manual_seed(4))
    export_pte(engine, out, calib_ids, ExportConfig(target="cpu-int8", context=4 * CHUNK, decode="int8"),
               model={"spec": QWEN3}, progress=False, tokenizer=lm.tokenizer)
    return engine, out


def test_qwen3_program_prefills_like_the_engine_in_both_runners(qwen3_program, tmp_path):
    from llmnpu_delegate.runtime.native import run_native
    from llmnpu_delegate.runtime.pte_runner import PteRunner
    from llmnpu_delegate.runtime.validate import sqnr_db

    engine, pte = qwen3_program
    ids = torch.randint(0, 1000, (2 * CHUNK + 3,), generator=torch.Generator().manual_seed(5))
    runner = PteRunner(pte)
    ours, want = runner(ids), engine(ids)
    # a cpu-int8 program's NPU methods give float outputs, as the engine's do; the difference is the
    # program's LM head, XNNPACK's dynamic INT8 linear under the INT8 decode (the engine's is float):
    # measured 37.6 dB (Zen 4). A float head program reaches >130 dB (test_export.py)
    assert sqnr_db(ours.logits, want.logits) > 30
    assert sqnr_db(ours.logits, want.logits) > sqnr_db(torch.randn_like(want.logits) * want.logits.std(),
                                                       want.logits) + 15
    gen = runner.generate(ids, 6)
    native = run_native(pte, ids.tolist(), runner.meta, 6, "ooo", logits_out=tmp_path / "l.bin")
    assert native.tokens == gen.tokens
    ref = ours.logits.numpy()
    logits = np.fromfile(tmp_path / "l.bin", dtype="<f4")[:ref.size]      # the prompt's row; decode's follow
    assert np.array_equal(logits, ref)        # the same methods in both runners: the same bits (measured)


def test_qwen3_simulates_on_a_phone_from_its_shapes():
    from llmnpu_delegate.simulate.phone import prepare, simulate_prefill

    # a given shadow plan: the automatic one is carried over from the embedded model's calibration
    # and priced per path (tests/test_simulate.py), not what this family's shapes test
    plan = {f"model.layers.0.self_attn.{p}_proj": 0.01 for p in "qkv"}
    scn = prepare("random:qwen3-0.6b", 256, pruning_rate=0.5, progress=False, plan=plan)
    r = simulate_prefill(scn, "SM8650", 512, ("ooo",))
    assert r["chunks"] == 2 and r["policies"]["ooo"]["tok_s"] > 0 and scn.shadowed == 3
