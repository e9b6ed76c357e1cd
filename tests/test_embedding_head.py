"""How a program stores the embedding table and the LM head (``lower/embedding_head.py``): float16 lookups and
the decode's dynamic INT8 head, each checked against a direct computation."""
import torch
from executorch.extension.pybindings.portable_lib import _load_for_executorch_from_buffer
from torch import nn

from llmnpu_delegate.lower.embedding_head import half_table_lookups, quantize_dynamic

VOCAB, HIDDEN = 300, 64


class Tied(nn.Module):
    """An embedding lookup and a head that reads the same table, as the tied families do."""

    def __init__(self, tie: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        h = self.embed(ids)
        return h, self.head(torch.tanh(h))


def _module(model):
    ids = torch.randint(0, VOCAB, (1, 7), generator=torch.Generator().manual_seed(1))
    return torch.export.export(model, (ids,), strict=False).module(), ids


def _float_tensors(ep) -> list[tuple]:
    """Shape and type of each distinct tensor the program holds (tied weights share one storage)."""
    tensors = {t.untyped_storage().data_ptr(): t for t in [*ep.state_dict.values(), *ep.constants.values()]}
    return [(tuple(t.shape), t.dtype) for t in tensors.values()]


def test_lookups_read_float16_rows_and_a_tied_head_keeps_the_float_table():
    model = Tied().eval()
    gm, ids = _module(model)
    assert half_table_lookups(gm) == 1
    h, logits = gm(ids)
    table = model.embed.weight.detach()
    # exactly the float16-rounded rows, widened: not the float32 rows
    assert torch.equal(h, table.half().float()[ids])
    assert not torch.equal(h, table[ids])
    # the tied head still reads the float32 table
    torch.testing.assert_close(logits, torch.tanh(h) @ table.t(), rtol=0, atol=1e-6)
    ep = torch.export.export(gm, (ids,), strict=False)
    assert sorted(_float_tensors(ep), key=str) == sorted([((VOCAB, HIDDEN), torch.float16),
                                                          ((VOCAB, HIDDEN), torch.float32)], key=str)


def test_an_untied_table_leaves_only_its_float16_copy_in_the_program():
    model = Tied(tie=False).eval()
    gm, ids = _module(model)
    half_table_lookups(gm)
    ep = torch.export.export(gm, (ids,), strict=False)
    # the head's own float32 weight stays; the table's float32 copy is gone
    assert sorted(_float_tensors(ep), key=str) == sorted([((VOCAB, HIDDEN), torch.float16),
                                                          ((VOCAB, HIDDEN), torch.float32)], key=str)
    assert torch.equal(gm(ids)[0], model.embed.weight.detach().half().float()[ids])


def _int8_per_channel(w):
    scale = w.abs().amax(1, keepdim=True) / 127
    return torch.round(w / scale).clamp(-127, 127) * scale


def _int8_per_token(x):
    lo, hi = x.amin(-1, keepdim=True).clamp(max=0), x.amax(-1, keepdim=True).clamp(min=0)
    scale = (hi - lo) / 255
    zero = torch.round(-128 - lo / scale)
    return ((torch.round(x / scale) + zero).clamp(-128, 127) - zero) * scale


def test_the_int8_head_is_the_dynamic_int8_product_on_xnnpack():
    """The head lowered as the decode lowers it: INT8 weights per output channel, activations INT8 per
    token at run time; against that computation done directly, far closer than to the float head."""
    from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
    from executorch.exir import to_edge_transform_and_lower

    torch.manual_seed(3)
    head = nn.Linear(HIDDEN, VOCAB, bias=False).eval()
    x = torch.randn(1, 4, HIDDEN) * torch.linspace(0.2, 3.0, HIDDEN)
    ep = quantize_dynamic(torch.export.export(head, (x,)).module(), [(x,)])
    edge = to_edge_transform_and_lower(ep, partitioner=[XnnpackPartitioner()])
    method = edge.exported_program("forward").graph_module
    assert any("lowered_module" in n.name for n in method.graph.nodes)          # on XNNPACK
    buffer = edge.to_executorch().buffer      # the loaded program reads its named data from these bytes
    got = _load_for_executorch_from_buffer(buffer).forward((x,))[0]
    w = head.weight.detach()
    want = _int8_per_token(x) @ _int8_per_channel(w).t()
    float_head = x @ w.t()
    quant_error = (float_head - want).norm()
    assert quant_error > 0
    assert (got - want).norm() < 0.1 * quant_error, ((got - want).norm(), quant_error)


def test_weights_folded_one_at_a_time_are_torchaos_fold():
    """``fold_weight_quantization`` against torchao's own folding of the same converted graph: the same
    INT8 weights under the same names, no quantize op on a constant left, no float weight kept."""
    from executorch.backends.xnnpack.quantizer.xnnpack_quantizer import (
        XNNPACKQuantizer,
        get_symmetric_quantization_config,
    )
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    from llmnpu_delegate.lower.embedding_head import fold_weight_quantization

    def prepared():
        gm, ids = _module(Tied(tie=False))
        config = get_symmetric_quantization_config(is_per_channel=True, is_dynamic=True)
        p = prepare_pt2e(gm, XNNPACKQuantizer().set_global(config))
        p(ids)
        return p, ids

    theirs = convert_pt2e(prepared()[0])
    mine, ids = prepared()
    ours = convert_pt2e(mine, fold_quantize=False)
    assert fold_weight_quantization(ours) == 1
    want = {k: v for k, v in theirs.state_dict().items() if v.dtype == torch.int8}
    got = {k: v for k, v in ours.state_dict().items() if v.dtype == torch.int8}
    assert want and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert not any("quantize_per_channel" in str(n.target) and "dequantize" not in str(n.target)
                   for n in ours.graph.nodes)
    assert {k for k, v in ours.state_dict().items() if v.dtype == torch.float32 and v.dim() == 2} == \
        {k for k, v in theirs.state_dict().items() if v.dtype == torch.float32 and v.dim() == 2}
    torch.testing.assert_close(ours(ids), theirs(ids), rtol=0, atol=0)
