"""Attention as an NPU graph computes it (kernels/npu_attention.py): its encodings' grid, an integer
pipeline computed independently here, the mask, and float attention as the limit of fine encodings."""
import pytest
import torch

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.kernels.attention import causal_mask, chunk_attention
from llmnpu_delegate.kernels.npu_attention import (PROBS, AttentionEncodings, Encoding, NpuAttention, attention_ranges,
                                                   npu_attention)

H, KVH, C, PAST, D = 4, 2, 8, 24, 16
SCALING = D ** -0.5


@pytest.fixture
def qkv():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, H, C, D, generator=g) * 2
    k = torch.randn(1, KVH, PAST + C, D, generator=g) * 3
    v = torch.randn(1, KVH, PAST + C, D, generator=g)
    return q, k, v, causal_mask(C, PAST + C)


def _encodings(qkv, kv_bits=16):
    q, k, v, mask = qkv
    out = chunk_attention(q, k, v, mask, SCALING, 0.0)
    return AttentionEncodings.of_ranges(attention_ranges(q, k, v, mask, SCALING, out), kv_bits)


@pytest.mark.parametrize("bits", [8, 16])
def test_an_encoding_rounds_to_its_grid_and_holds_zero(bits):
    enc = Encoding.of_range(-0.7, 2.3, bits)
    x = torch.linspace(-1.0, 3.0, 1001)
    r = enc.round(x)
    steps = r / enc.scale + enc.zero
    assert torch.allclose(steps, steps.round(), atol=1e-3)
    assert steps.min() >= 0 and steps.max() <= 2 ** bits - 1
    assert enc.round(torch.zeros(1)).item() == 0.0
    inside = (x >= -0.7) & (x <= 2.3)
    assert (r[inside] - x[inside]).abs().max() <= enc.scale / 2 + 1e-7
    assert r[~inside].abs().max() <= 2.3 + enc.scale       # clamped to the range


def test_the_window_is_signed_symmetric_and_the_grids_reach_past_the_ranges(qkv):
    from llmnpu_delegate.kernels.npu_attention import HEADROOM, MASK_DEPTH
    q, k, v, mask = qkv
    for bits in (8, 16):
        enc = _encodings(qkv, bits)
        reach = HEADROOM if bits == 16 else 1.0       # an 8-bit window has no resolution to spare
        for e, x in ((enc.k, k), (enc.v, v)):
            assert e.signed and e.zero == 0 and e.codes == (1 - 2 ** (bits - 1), 2 ** (bits - 1) - 1)
            assert e.scale * e.codes[1] == pytest.approx(reach * float(x.abs().max()))
            assert torch.equal(e.round(-x), -e.round(x))
        assert not enc.q.signed and not enc.scores.signed
        top = (2 ** 16 - 1 - enc.q.zero) * enc.q.scale
        assert top == pytest.approx(HEADROOM * float(q.max()), rel=1e-3)
        scores = torch.einsum("hcd,hld->hcl", q[0].reshape(KVH, -1, D), k[0]) * SCALING
        seen = scores.view(KVH, H // KVH, C, -1)[:, :, mask.reshape(C, -1)]     # what the mask lets through
        assert enc.scores.floor == pytest.approx(HEADROOM * float(seen.min()) - MASK_DEPTH, abs=enc.scores.scale)


def _integer_pipeline(q, k, v, mask, enc: AttentionEncodings):
    """The same attention on integers: each tensor's codes, products summed exactly in int64, each
    result scaled and rounded to the next encoding."""
    def codes(x, e):
        return (torch.clamp(torch.round(x / e.scale) + e.zero, *e.codes) - e.zero).to(torch.int64)

    g = H // KVH
    qi = codes(q, enc.q).reshape(KVH, g * C, D)
    ki, vi = codes(k[0], enc.k), codes(v[0], enc.v)
    scores = torch.bmm(qi, ki.transpose(1, 2)).double() * (enc.q.scale * enc.k.scale * SCALING)
    scores = enc.scores.round(scores.float()).view(KVH, g, C, -1)
    scores = scores.masked_fill(~mask.reshape(C, -1), enc.scores.floor)     # the mask's add clamps there
    probs = torch.softmax(scores.reshape(KVH, g * C, -1), -1)
    pi = codes(probs, PROBS)
    out = torch.bmm(pi, vi).double() * (PROBS.scale * enc.v.scale)
    return enc.out.round(out.float()).view(1, H, C, D).transpose(1, 2)


@pytest.mark.parametrize("kv_bits", [8, 16])
def test_npu_attention_is_the_integer_pipeline(qkv, kv_bits):
    enc = _encodings(qkv, kv_bits)
    got = npu_attention(*qkv, SCALING, enc)
    want = _integer_pipeline(*qkv, enc)
    steps = ((got - want).abs() / enc.out.scale).round()
    # float32 sums of exact products may land a score or an output on the next grid step at a tie
    # (measured: none here, with either window; 0.2 % one step off before the window was symmetric)
    assert steps.max() <= 1 and (steps > 0).float().mean() < 0.01


def test_masked_keys_are_never_read(qkv):
    q, k, v, mask = qkv
    enc = _encodings(qkv)
    v2 = v.clone()
    v2[0, :, -1] = 1e4          # the last key: only the last query may look at it
    a, b = npu_attention(q, k, v, mask, SCALING, enc), npu_attention(q, k, v2, mask, SCALING, enc)
    assert torch.equal(a[0, :-1], b[0, :-1]) and not torch.equal(a[0, -1], b[0, -1])


def test_sixteen_bits_stay_near_float_attention_and_an_8_bit_window_costs_more(qkv):
    want = chunk_attention(*qkv, SCALING, 0.0)
    span = float(want.max() - want.min())
    err = {bits: float((npu_attention(*qkv, SCALING, _encodings(qkv, bits)) - want).abs().max()) / span
           for bits in (8, 16)}
    # measured: 1.3e-4 and 1.0e-2 of the output's span
    assert err[16] < 5e-4               # a few steps of 16-bit grids, through softmax
    assert err[8] > 20 * err[16]        # the window's 256 levels dominate
    assert err[8] < 0.05


def test_softcapped_attention_has_no_npu_form(qkv):
    with pytest.raises(LlmNpuError, match="softcapping"):
        NpuAttention(_encodings(qkv))(*qkv, SCALING, 30.0)
    with pytest.raises(LlmNpuError, match="8 or 16 bits"):
        AttentionEncodings.of_ranges({n: (-1.0, 1.0) for n in ("q", "k", "v", "scores", "out")}, 4)
