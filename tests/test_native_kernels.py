"""The compiled kernels (llmnpu_delegate/kernels/native/) against their torch-ops twins and a dense
float reference."""
import pytest
import torch

from llmnpu_delegate.kernels import native_ops
from llmnpu_delegate.kernels.native_ops import native_available
from llmnpu_delegate.kernels.ops import shadow_product, shadow_product_reference


def _activations(m, k, rate, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    hits = torch.rand(m, k, generator=g) < rate
    return torch.where(hits, x.sign() * (4 + 20 * torch.rand(m, k, generator=g)), x)


@pytest.fixture(autouse=True, scope="module")
def _loaded():
    """The tests call the library's operators directly, and it loads on first use: a test run alone
    (``-k``) must load it too."""
    native_available()


def test_the_library_is_built_and_loaded():
    """`make test` builds it first: without it the shadow product silently runs ~3x slower."""
    assert native_available()


def _split(table, hot):
    """W^T split as RowStore splits it: ``hot`` channels' rows in one table, the rest in another."""
    k = table.shape[0]
    is_hot = torch.zeros(k, dtype=torch.bool)
    is_hot[hot] = True
    hot_ch, cold_ch = torch.nonzero(is_hot).flatten(), torch.nonzero(~is_hot).flatten()
    slot = torch.empty(k, dtype=torch.int64)
    slot[hot_ch] = torch.arange(hot_ch.numel())
    slot[cold_ch] = -1 - torch.arange(cold_ch.numel())
    return table[hot_ch].contiguous(), table[cold_ch].contiguous(), slot


@pytest.mark.parametrize("m,k,n,rate", [(256, 576, 1536, 0.01), (1, 64, 7, 0.1), (33, 100, 17, 0.5), (8, 16, 3, 0.0),
                                         (9, 40, 100, 0.3)])   # n = 100: a 64-wide register tile and a tail
def test_shadow_product_is_the_residue_times_w_rows(m, k, n, rate):
    x = _activations(m, k, rate, seed=m + k)
    table = torch.randn(k, n, generator=torch.Generator().manual_seed(1))
    hot, cold, slot = _split(table, torch.arange(0, k, 3))          # every third channel's row is hot
    t = 3.0
    residue = x - x.clamp(-t, t)
    dense = residue.double() @ table.double()
    y, channels, outliers = torch.ops.llmnpu_native.shadow_product(x, t, hot, cold, slot)
    y_ref, channels_ref, outliers_ref = shadow_product_reference(x, t, hot, cold, slot)
    assert outliers == outliers_ref == int((residue != 0).sum())
    assert channels.tolist() == channels_ref.tolist() == torch.nonzero((residue != 0).any(0)).flatten().tolist()
    # fp32 sums in another order: errors of a few ulps of the largest partial sums
    scale = (residue.abs().double() @ table.abs().double()).max().item() + 1e-30
    assert (y.double() - dense).abs().max().item() <= 1e-5 * scale
    assert (y_ref.double() - dense).abs().max().item() <= 1e-5 * scale
    # sparse for real: the rows of channels without an outlier are never read (NaN there would show,
    # even multiplied by zero), in either table
    unhit = torch.ones(k, dtype=torch.bool)
    unhit[channels] = False
    poisoned = table.clone()
    poisoned[unhit] = float("nan")
    for fn in (torch.ops.llmnpu_native.shadow_product, shadow_product_reference):
        y_poisoned, _, _ = fn(x, t, *_split(poisoned, torch.arange(0, k, 3)))
        assert torch.equal(y_poisoned, y) if fn is not shadow_product_reference else torch.equal(y_poisoned, y_ref)


@pytest.mark.parametrize("fn", ["native", "torch-ops"])
@pytest.mark.parametrize("m,k,n,rate", [(256, 576, 1536, 0.01), (33, 100, 17, 0.5), (9, 40, 100, 0.3), (8, 16, 3, 0.0)])
def test_shadow_product_added_in_place_is_the_product_then_the_add_bit_for_bit(fn, m, k, n, rate):
    """The merge of a shadow branch into its linear's output: the same bits as the product computed
    apart and added after (a placement may do either), and the rows without an outlier untouched."""
    if fn == "native" and not native_available():
        pytest.skip("the native kernels are not built")
    from llmnpu_delegate.kernels.ops import shadow_product_add_
    x = _activations(m, k, rate, seed=m + n)
    tables = _split(torch.randn(k, n, generator=torch.Generator().manual_seed(2)), torch.arange(1, k, 4))
    y = torch.randn(m, n, generator=torch.Generator().manual_seed(3))
    y[0] = -0.0                                               # untouched means untouched: -0.0 stays
    # against the same path's own product, added after (the torch-ops product sums in another order)
    product_of = torch.ops.llmnpu_native.shadow_product if fn == "native" else shadow_product_reference
    product, channels_want, outliers_want = product_of(x, 3.0, *tables)
    want = y + product
    add = torch.ops.llmnpu_native.shadow_product_add_ if fn == "native" else None
    got = y.clone()
    if add is None:
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr("llmnpu_delegate.kernels.ops.native_available", lambda: False)
            channels, outliers = shadow_product_add_(got, x, 3.0, *tables)
    else:
        channels, outliers = add(got, x, 3.0, *tables)
    assert torch.equal(got, want) and outliers == outliers_want and channels.tolist() == channels_want.tolist()
    clean = ~(x.abs() > 3.0).any(1)
    if fn == "native":
        assert torch.equal(got[clean], y[clean]) and torch.equal(got[clean].signbit(), y[clean].signbit())
    if rate:
        assert not torch.equal(got, y)


def test_shadow_product_added_in_place_refuses_an_output_it_cannot_write():
    if not native_available():
        pytest.skip("the native kernels are not built")
    hot, cold, slot = _split(torch.randn(8, 4), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="contiguous float"):
        torch.ops.llmnpu_native.shadow_product_add_(torch.zeros(4, 6).t(), torch.randn(6, 8), 1.0, hot, cold, slot)
    with pytest.raises(RuntimeError, match="contiguous float"):
        torch.ops.llmnpu_native.shadow_product_add_(torch.zeros(5, 4), torch.randn(6, 8), 1.0, hot, cold, slot)


def test_shadow_product_at_threshold_zero_is_the_whole_product_and_takes_views():
    x = torch.randn(40, 24).t()                 # a non-contiguous [24, 40] view
    table = torch.randn(40, 9)
    y, channels, outliers = shadow_product(x, 0.0, *_split(table, torch.tensor([3, 39])))
    torch.testing.assert_close(y, x @ table, rtol=1e-5, atol=1e-5)
    assert outliers == x.numel() and channels.tolist() == list(range(40))


def test_shadow_product_refuses_what_it_cannot_multiply():
    hot, cold, slot = _split(torch.randn(8, 3), torch.tensor([1]))
    with pytest.raises(RuntimeError, match="slot must be"):
        torch.ops.llmnpu_native.shadow_product(torch.randn(4, 8), 1.0, hot, cold, slot[:7])
    with pytest.raises(RuntimeError, match="x must be"):
        torch.ops.llmnpu_native.shadow_product(torch.randn(4, 8).double(), 1.0, hot, cold, slot)
    with pytest.raises(RuntimeError, match="hot and cold must be"):
        torch.ops.llmnpu_native.shadow_product(torch.randn(4, 8), 1.0, hot, torch.randn(7, 4), slot)
    with pytest.raises(RuntimeError, match="names no row"):
        torch.ops.llmnpu_native.shadow_product(torch.randn(4, 8), 1.0, hot, cold[:3], slot)


def test_fused_rms_norm_is_the_decomposed_one():
    x, w = 3 * torch.randn(2, 37, 100), torch.randn(100)
    want = native_ops.rms_norm_reference(x.double(), w.double(), 1e-6)
    got = torch.ops.llmnpu_native.rms_norm(x, w, 1e-6)
    assert (got.double() - want).abs().max() <= 1e-6 * want.abs().max()


def test_fused_silu_mul_is_silu_times_up_in_place():
    gate, up = 6 * torch.randn(3, 1000 + 7), torch.randn(3, 1000 + 7)   # a tail past the last 16 lanes
    gate[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])              # exp's clamps
    want = torch.nn.functional.silu(gate.double()) * up.double()
    out = torch.ops.llmnpu_native.silu_mul_(gate, up)
    assert out.data_ptr() == gate.data_ptr()
    assert (gate.double() - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(RuntimeError, match="contiguous"):
        torch.ops.llmnpu_native.silu_mul_(torch.randn(8, 4).t(), torch.randn(4, 8))


def test_linear_bf16w_is_the_bf16_weights_in_fp32_arithmetic():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(3, 1, 207, generator=g), torch.randn(1000, 207, generator=g), torch.randn(1000, generator=g)
    wb = w.to(torch.bfloat16)                       # K = 207: a tail past the last 32 lanes
    got = torch.ops.llmnpu_native.linear_bf16w(x, wb, b)
    want = torch.nn.functional.linear(x.double(), wb.double(), b.double())
    scale = (x.abs().double() @ wb.double().abs().t()).max().item()
    assert got.shape == (3, 1, 1000)
    assert (got.double() - want).abs().max() <= 1e-6 * scale               # fp32 sums of exact products
    # and the weights really are the bf16 ones: against fp32 weights the rounding shows, far above that
    exact = torch.nn.functional.linear(x.double(), w.double(), b.double())
    assert (got.double() - exact).abs().max() > 1e-4 * scale
    with pytest.raises(RuntimeError, match="weight must be bf16"):
        torch.ops.llmnpu_native.linear_bf16w(x, w, None)


@pytest.mark.parametrize("z", ["none", "tensor", "scalar"])
def test_fused_add_rms_norm_is_the_aten_adds_then_the_norm(z):
    g = torch.Generator().manual_seed(4)
    x, y, w = 3 * torch.randn(2, 37, 100, generator=g), torch.randn(2, 37, 100, generator=g), torch.randn(100, generator=g)
    delta = {"none": None, "tensor": torch.randn(2, 37, 100, generator=g), "scalar": torch.zeros(())}[z]
    s, normed = torch.ops.llmnpu_native.add_rms_norm(x, y, delta, w, 1e-6)
    want = x + (y if delta is None else y + delta)                 # the exported graph's two adds
    assert torch.equal(s, want)
    assert torch.equal(normed, torch.ops.llmnpu_native.rms_norm(want, w, 1e-6))
    with pytest.raises(RuntimeError, match="z must be"):
        torch.ops.llmnpu_native.add_rms_norm(x, y, torch.randn(3), w, 1e-6)
