"""lower/xnnpack_forms.py: the rewrites keep every value, and they keep the decode step in few partitions."""
import torch
from torch import nn

from llmnpu_delegate.capture import kv_shape
from llmnpu_delegate.lower import decode as program_decode
from llmnpu_delegate.lower.xnnpack_forms import for_xnnpack
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
