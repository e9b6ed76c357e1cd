"""The rewrites of CPU subgraphs (runtime/fuse.py) and the rotary-embedding kernel they call: the
kernel against transformers' own apply_rotary_pos_emb, the rewritten subgraphs against the
subgraphs as exported, bit for bit."""
import copy
import operator

import pytest
import torch
from conftest import missing
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.kernels import native_ops
from llmnpu_delegate.models import load_model
from llmnpu_delegate.partitioner.regions import shadow_delta, subgraph_module
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.runtime.fuse import _bf16_attention, _bf16_weight_head, fuse_cpu_subgraph
from llmnpu_delegate.runtime.program import _private_inputs

_aten = torch.ops.aten


def _rotary(chunk, dim, start):
    inv = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))
    angles = torch.arange(start, start + chunk).float()[:, None] * inv[None]
    emb = torch.cat([angles, angles], -1)[None]
    return emb.cos(), emb.sin()                              # [1, C, d], as HF's rotary module


@pytest.mark.parametrize("rope", [native_ops.rope, native_ops.rope_reference], ids=["native", "torch-ops"])
@pytest.mark.parametrize("heads,kv_heads,chunk,past,dim", [(9, 3, 37, 0, 64), (4, 4, 16, 21, 32), (2, 1, 1, 5, 8)])
def test_rope_is_hf_apply_rotary_pos_emb_bit_for_bit(rope, heads, kv_heads, chunk, past, dim):
    g = torch.Generator().manual_seed(chunk + dim)
    # the projections' outputs seen per head: strided views, as in the exported graph
    q = (5 * torch.randn(1, chunk, heads * dim, generator=g)).view(1, chunk, heads, dim).transpose(1, 2)
    k = (5 * torch.randn(1, chunk, kv_heads * dim, generator=g)).view(1, chunk, kv_heads, dim).transpose(1, 2)
    past_k = torch.randn(1, kv_heads, past, dim, generator=g)
    cos, sin = _rotary(chunk, dim, past)
    want_q, want_k = apply_rotary_pos_emb(q, k, cos, sin)
    got_q = rope(q, cos[:, None], sin[:, None])
    got_k = rope(k, cos[:, None], sin[:, None], past_k)
    assert got_q.is_contiguous() and got_k.is_contiguous()
    assert torch.equal(got_q, want_q)
    assert torch.equal(got_k, torch.cat([past_k, want_k], -2))


def test_rope_refuses_what_it_cannot_rotate():
    if not native_ops.native_available():
        pytest.skip(missing("the native kernels (make kernels)"))
    x, cos = torch.randn(1, 2, 4, 8), torch.randn(1, 4, 8)
    with pytest.raises(RuntimeError, match="one \\[d\\] row per position"):
        torch.ops.llmnpu_native.rope(x, cos[:, :3], cos[:, :3], None)
    with pytest.raises(RuntimeError, match="even"):
        torch.ops.llmnpu_native.rope(torch.randn(1, 2, 4, 7), torch.randn(28), torch.randn(28), None)
    with pytest.raises(RuntimeError, match="past must be"):
        torch.ops.llmnpu_native.rope(x, cos, cos, torch.randn(1, 3, 5, 8))


def _cpu_subgraphs(engine):
    """(chunk, step, its inputs, its subgraph as exported, its private inputs) for every CPU step of
    a real three-chunk prompt, run in program order."""
    by_name = {n.name: n for n in engine.partition.graph_module.graph.nodes}
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(5))
    for chunk, i, inputs, _ in engine.program.run_in_order(engine.feeds(ids)):
        sub = engine.program.steps[i].sub
        if sub.kind == "cpu":
            yield chunk, i, inputs, subgraph_module(engine.partition, sub), _private_inputs(sub, by_name)


@pytest.mark.parametrize("attention", ["fp32", "bf16"])
def test_fused_subgraphs_compute_what_the_exported_ones_do(attention):
    """The CPU subgraphs of a float engine, as exported and as rewritten, on the data of a real
    three-chunk prompt. Attention subgraphs: same bits out (the bf16 swaps go into both, so only
    the rewrites differ), the rope op in place of the chains it replaced. Norm subgraphs: the
    residual adds inside the fused norm, outputs equal to fp32 rounding."""
    if attention == "bf16" and not native_ops.native_available():
        pytest.skip(missing("the native kernels (make kernels)"))
    if attention == "bf16" and not native_ops.bf16_attention_available():
        pytest.skip("this CPU has no AVX-512 BF16: no bf16 attention kernel")
    lm = load_model("random:tiny-llama")
    engine = Prefiller(lm, 16, quant=None, cache=GraphCache(), progress=False, attention=attention)
    checked, fused_norms = set(), 0
    with torch.inference_mode():
        for chunk, i, inputs, exported, private in _cpu_subgraphs(engine):
            rewritten = copy.deepcopy(exported)
            fuse_cpu_subgraph(rewritten, private, attention)
            if attention == "bf16":       # the precision swaps into both: what differs is the rewrites
                _bf16_attention(exported)
                _bf16_weight_head(exported)
                exported.recompile()
            targets = [n.target for n in rewritten.graph.nodes]
            if native_ops.add_rms_norm in targets:
                # the residual adds joined the norm: no aten add is left, and the outputs are the
                # exported ones up to the norm's own summation order (its kernel test is exact)
                assert not {_aten.add.Tensor, operator.add} & set(targets)
                want = exported(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
                got = rewritten(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
                assert all((a - b).abs().max() <= 1e-6 * b.abs().max() for a, b in zip(got, want))
                fused_norms += 1
            if native_ops.rope not in targets:
                continue
            assert _aten.neg.default not in targets and _aten.lift_fresh_copy.default not in targets
            want = exported(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
            got = rewritten(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
            assert all(torch.equal(a, b) for a, b in zip(got, want)), f"chunk {chunk}, subgraph {i}"
            checked.add(chunk)
    assert checked == {0, 1, 2}, "no attention subgraph was rewritten"
    assert fused_norms >= 3 * 2 * engine.kv.layers - 3, "residual adds were not fused into the norms"


@pytest.mark.parametrize("placement", ["paper", "norms"])
def test_shadow_products_merge_into_their_linears_outputs(placement):
    """A shadowed engine's CPU subgraphs, as exported (their shadow paths bound) and as rewritten:
    where a linear's output and its shadow product meet, the product is added into the output in
    place (inside the subgraph that computes it under ``norms``; an in-place add of the paper's
    separate shadow subgraph's product under ``paper``), and no [C, N] sum is made. Outputs: the
    exported ones, bit for bit except where the gated MLP's activation became the one-pass
    ``silu_mul_`` (its own rounding of silu; measured ~1e-7 of the range)."""
    from llmnpu_delegate.quantize import quant_config
    from llmnpu_delegate.runtime.program import _bind_shadow
    lm = load_model("random:tiny-llama")
    # every shadow path kept: an automatic pruning would choose by timing this machine
    quant = quant_config("w8a8-shadow", pruning_rate=0.0)
    engine = Prefiller(lm, 16, quant=quant, cache=GraphCache(), progress=False, placement=placement)
    by_name = {n.name: n for n in engine.partition.graph_module.graph.nodes}
    merges = 0
    with torch.inference_mode():
        for chunk, i, inputs, exported, private in _cpu_subgraphs(engine):
            _bind_shadow(exported, None, engine.program.shadow)
            rewritten = copy.deepcopy(exported)
            fuse_cpu_subgraph(rewritten, private)
            nodes = list(rewritten.graph.nodes)
            merged = [n for n in nodes if (n.op == "call_module" and "into" in n.kwargs)
                      or n.target == _aten.add_.Tensor]
            if not merged:
                continue
            merges += len(merged)
            # no add of a shadow product is left to make a new buffer
            shadowed = {n.name for n in nodes if n.op == "call_module"} | {
                n.name for n in nodes if n.op == "placeholder" and by_name[n.name].target is shadow_delta}
            assert not [n for n in nodes if n.target in (_aten.add.Tensor, operator.add)
                        and any(getattr(a, "name", None) in shadowed for a in n.args)]
            want = exported(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
            got = rewritten(*[x.clone() if isinstance(x, torch.Tensor) else x for x in inputs])
            if native_ops.silu_mul_ in {n.target for n in nodes}:
                assert all((a - b).abs().max() <= 1e-6 * b.abs().max() for a, b in zip(got, want))
            else:
                assert all(torch.equal(a, b) for a, b in zip(got, want)), f"chunk {chunk}, subgraph {i}"
    assert merges >= 3 * engine.kv.layers, "no shadow product was merged into its linear's output"
