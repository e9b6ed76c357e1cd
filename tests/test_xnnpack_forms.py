"""lower/xnnpack_forms.py: the rewrites keep every value, and they keep the decode step in few partitions."""
import operator

import torch
from torch import nn

from llmnpu_delegate.chunk_step import kv_shape
from llmnpu_delegate.lower import decode_method as program_decode
from llmnpu_delegate.lower.xnnpack_forms import for_xnnpack, mark_as_rows
from llmnpu_delegate.models import load_model


class _NormAndConcat(nn.Module):
    """An RMS norm over the last dim (rank 3 and rank 4, as q/k norms are) and a K/V append to an empty cache."""

    def forward(self, x, heads, empty):
        h = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        q = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6)
        return h, q, torch.cat([empty, x], dim=-2)


def test_rewrites_keep_the_values_and_leave_no_last_dim_mean():
    args = (torch.randn(1, 5, 48), torch.randn(1, 5, 3, 16), torch.zeros(1, 0, 48))
    ep = torch.export.export(_NormAndConcat(), args, strict=False)
    want = ep.module()(*args)
    assert for_xnnpack(ep.graph_module) == {"means": 2, "concats": 1}
    got = ep.module()(*args)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
    means = [n for n in ep.graph_module.graph.nodes if n.target == torch.ops.aten.mean.dim]
    assert means and all(n.args[0].meta["val"].dim() == 4 and list(n.args[1]) == [2, 3] for n in means)
    assert not any(n.target == torch.ops.aten.cat.default for n in ep.graph_module.graph.nodes)


def test_decode_step_is_two_xnnpack_partitions_per_layer():
    """Each portable op between two layers' XNNPACK ops is a delegate call per token: 6 per layer before
    the rewrites (the norms' means, the position mask, the new key's score, the K/V concats)."""
    lm = load_model("random:tiny-llama")
    model = lm.model.eval()
    layers = model.config.num_hidden_layers
    ids = torch.randint(0, 1000, (1, 8), generator=torch.Generator().manual_seed(0))
    for mode in ("fp32", "int8"):
        gm = program_decode.export_decode(model, kv_shape(model.config), 64, mode, ids).exported_program("forward").graph_module
        calls = sum("executorch_call_delegate" in str(n.target) for n in gm.graph.nodes)
        assert calls <= 2 * layers + 2, (mode, calls)


class _TwoLinears(nn.Module):
    """q/k-like linears sharing one rank-3 input (one with a bias, as Qwen2's), and one more on their sum."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.a, self.b, self.c = nn.Linear(48, 40), nn.Linear(48, 40, bias=False), nn.Linear(40, 24, bias=False)
        for lin in (self.a, self.b, self.c):
            lin.weight.data = torch.randn(lin.weight.shape, generator=g)
        self.a.bias.data = torch.randn(40, generator=g)

    def forward(self, x):
        return self.c(self.a(x) + self.b(x))


def _xnnpack_outputs(ep, x):
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower
    from executorch.runtime import Runtime

    program = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()]).to_executorch()
    left = {str(n.target) for n in program.exported_program().graph.nodes if n.op == "call_function"
            and "executorch_call_delegate" not in str(n.target) and n.target is not operator.getitem}
    method = Runtime.get().load_program(program.buffer).load_method("forward")
    return method.execute([x])[0], program.buffer, left


def test_int8_weights_as_w_transposed_rows_give_the_same_bits():
    """XNNPACK's dynamic INT8 linears with their weights stored as W^T rows (``int8_weights_as_rows``)
    give the bits of the plain linears, all inside XNNPACK, and the program then holds each weight's
    codes as W^T rows (what the shadow path reads) and not as W."""
    from llmnpu_delegate.kernels.ops import quantize_weight
    from llmnpu_delegate.lower import embedding_head as table

    model = _TwoLinears().eval()
    x = torch.randn(1, 7, 48, generator=torch.Generator().manual_seed(1))
    x[..., 5] *= 30
    marked = torch.export.export(model, (x,), strict=False).module()
    mark_as_rows(n for n in marked.graph.nodes if n.target == torch.ops.aten.linear.default)
    rows_ep = table.quantize_dynamic(marked, [(x,)])
    plain_ep = table.quantize_dynamic(torch.export.export(model, (x,), strict=False).module(), [(x,)])  # not marked
    assert not any(n.target == torch.ops.aten.linear.default for n in rows_ep.graph.nodes)
    got, buffer, left = _xnnpack_outputs(rows_ep, x)
    want, plain_buffer, _ = _xnnpack_outputs(plain_ep, x)
    assert not left and got.shape == (1, 7, 24)        # all of it in XNNPACK
    assert torch.equal(got, want)
    # it is INT8: off the float model by the quantization's size (a float product summed in another
    # order would be off by ~1e-6 of the output's range, INT8 by ~1e-2), and not by more
    ref = model(x).detach()
    gap = float((got - ref).abs().max() / ref.abs().max())
    assert 1e-3 < gap < 5e-2, gap
    for lin in (model.a, model.b, model.c):
        q, _ = quantize_weight(lin.weight, "channel")
        assert bytes(buffer).find(q.t().contiguous().numpy().tobytes()) >= 0
        assert bytes(buffer).find(q.numpy().tobytes()) < 0 <= bytes(plain_buffer).find(q.numpy().tobytes())
