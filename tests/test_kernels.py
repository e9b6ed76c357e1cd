"""Parity of the custom ops against plain float/integer references, and their export contract."""
import pytest
import torch
from hypothesis import given, settings, strategies as st

from llmnpu_delegate import kernels as K
from llmnpu_delegate.kernels.ops import int8_linear_reference


def ref_quantize(x, scale):
    return torch.clamp(torch.round(x.double() / scale), -127, 127)


def ref_int_linear(q_x, x_scale, w_q, w_scale, bias):
    # exact integer products in float64 (|sum| < 2^53), then scales
    acc = q_x.double() @ w_q.double().t()
    out = acc * (w_scale.double() * x_scale)
    return out if bias is None else out + bias.double()


@given(m=st.integers(1, 40), k=st.integers(1, 70), scale=st.floats(1e-3, 10.0), seed=st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_quantize_matches_reference(m, k, scale, seed):
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(seed)) * 200   # reproducible by hypothesis
    q = K.quantize(x, scale)
    assert q.dtype == torch.int8
    assert q.min() >= -127  # symmetric: -128 never appears
    ref = ref_quantize(x, scale)
    # The kernel divides in float32: where x / scale lies within float32's rounding of a .5 tie it may
    # round to the other neighbour (seen once in CI). Everywhere else it is exact; at a tie, one step.
    exact = x.double() / scale
    tie = (exact - exact.floor() - 0.5).abs() <= 1e-6 * exact.abs().clamp(min=1)
    assert torch.equal(q.double()[~tie], ref[~tie])
    assert bool(((q.double()[tie] - ref[tie]).abs() <= 1).all())


def test_quantize_saturates_at_threshold():
    t = 3.0
    x = torch.tensor([[-100.0, -3.0, 0.0, 1.5, 3.0, 7.0]])
    q = K.quantize(x, t / 127)
    assert q.tolist() == [[-127, -127, 0, 64, 127, 127]]
    assert torch.allclose(K.dequantize(q, t / 127), x.clamp(-t, t), atol=t / 127 / 2)


@pytest.mark.parametrize("m,k,n", [(1, 8, 4), (7, 33, 19), (64, 96, 128), (256, 896, 300)])
def test_int8_linear_accumulates_exactly(m, k, n):
    """With unit scales the output is the int32 accumulator itself (|acc| <= 127^2 * 896 < 2^24, so
    float32 holds it exactly): compared as integers with an int64 matmul."""
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    x_q[0], w_q[0] = 127, -127          # the extreme products
    acc = x_q.long() @ w_q.long().t()
    for out in (K.int8_linear(x_q, 1.0, w_q, torch.ones(n)), int8_linear_reference(x_q, 1.0, w_q, torch.ones(n), None)):
        assert out.dtype == torch.float32 and out.shape == (m, n)
        assert torch.equal(out, out.round()) and torch.equal(out.long(), acc)


@pytest.mark.parametrize("m,k,n", [(1, 8, 4), (64, 96, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_int8_linear_epilogue(m, k, n, with_bias):
    """Scales and bias on the accumulator: float32 rounding of acc * x_scale * w_scale[n] + bias."""
    x_q = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    w_scale = torch.rand(n) * 0.01 + 1e-4
    bias = torch.randn(n) if with_bias else None
    ref = ref_int_linear(x_q, 0.02, w_q, w_scale, bias)
    for out in (K.int8_linear(x_q, 0.02, w_q, w_scale, bias), int8_linear_reference(x_q, 0.02, w_q, w_scale, bias)):
        torch.testing.assert_close(out.double(), ref, rtol=1e-6, atol=1e-6)


@given(m=st.integers(1, 30), k=st.integers(2, 64), n=st.integers(1, 40))
@settings(max_examples=30, deadline=None)
def test_w8a8_linear_equals_quantize_then_int8_linear(m, k, n):
    """The fused op quantizes exactly as the reference (integers) and then runs the same integer GEMM:
    its output is bit for bit that of int8_linear on the reference's integers."""
    x = torch.randn(m, k) * 5
    w_q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    w_scale = torch.rand(n) * 0.01 + 1e-4
    s = 0.03
    q = ref_quantize(x, s).to(torch.int8)
    assert torch.equal(K.w8a8_linear(x, s, w_q, w_scale, None), K.int8_linear(q, s, w_q, w_scale, None))
    assert torch.equal(K.w8a8_linear(x, 1.0, w_q, torch.ones(n), None).long(),
                       ref_quantize(x, 1.0).long() @ w_q.long().t())


def test_outlier_extract_and_compensate():
    x = torch.rand(6, 10) * 2 - 1
    x[2, 4] = 50.0
    x[5, 7] = -40.0
    channels, residue = K.outlier_extract(x, 3.5)
    assert channels.tolist() == [4, 7]
    assert torch.count_nonzero(residue) == 2
    full = torch.zeros_like(x)
    full[:, channels] = residue
    torch.testing.assert_close(full, x - x.clamp(-3.5, 3.5))
    w_rows = torch.randn(channels.numel(), 5)
    y = torch.randn(6, 5)
    torch.testing.assert_close(K.outlier_compensate(y, residue, w_rows), y + residue @ w_rows)


def test_outlier_compensate_sparse_and_dense_agree():
    residue = torch.zeros(64, 40)
    residue[torch.randint(0, 64, (30,)), torch.randint(0, 40, (30,))] = torch.randn(30) * 50  # scattered
    y, w_rows = torch.randn(64, 12), torch.randn(40, 12)
    torch.testing.assert_close(K.outlier_compensate(y, residue, w_rows), y + residue @ w_rows)


@settings(max_examples=25, deadline=None)
@given(m=st.integers(1, 40), k=st.integers(1, 30), n=st.integers(1, 70), rate=st.sampled_from([0.05, 0.3, 1.0]),
       seed=st.integers(0, 2**16))
def test_outlier_product_in_order_is_the_row_by_row_sum(m, k, n, rate, seed):
    """Against one running float32 sum per row, channel by channel, each product rounded before its add
    (numpy: no FMA), as the native runner's cold rows sum: the same bits. And it is the product:
    close to the float64 one. Rows with many outliers and rows with none are both drawn."""
    import numpy as np

    g = torch.Generator().manual_seed(seed)
    residue = torch.randn(m, k, generator=g) * 100
    residue[torch.rand(m, k, generator=g) > rate] = 0.0
    w_rows = torch.randn(k, n, generator=g)
    got = K.outlier_product_in_order(residue, w_rows)
    r, w = residue.numpy(), w_rows.numpy()
    want = np.zeros((m, n), dtype=np.float32)
    for i in range(m):
        for c in range(k):
            if r[i, c] != 0:
                want[i] = want[i] + np.float32(r[i, c]) * w[c]
    assert got.numpy().tobytes() == want.tobytes()
    assert _within_sum_bound(got, residue, w_rows)


def test_outlier_product_in_order_differs_from_a_gemm_in_the_last_bits():
    """Why it exists: a GEMM sums in another order, and some outputs differ by a float32 step (the
    test above would pass a plain ``residue @ w_rows`` only if this one failed)."""
    g = torch.Generator().manual_seed(0)
    residue, w_rows = torch.randn(64, 48, generator=g) * 100, torch.randn(48, 256, generator=g)
    got = K.outlier_product_in_order(residue, w_rows)
    assert not torch.equal(got, residue @ w_rows)
    assert _within_sum_bound(got, residue, w_rows) and _within_sum_bound(residue @ w_rows, residue, w_rows)


def _within_sum_bound(got, residue, w_rows) -> bool:
    """Within float32 summation's error bound of the exact product: k steps of rounding on the sum of
    the terms' magnitudes."""
    exact = residue.double() @ w_rows.double()
    bound = residue.shape[1] * 2.0**-23 * (residue.double().abs() @ w_rows.double().abs())
    return bool(((got.double() - exact).abs() <= bound).all())


def test_outlier_extract_none():
    channels, residue = K.outlier_extract(torch.ones(3, 4), 2.0)
    assert channels.numel() == 0 and residue.shape == (3, 0)


def test_opcheck_all_ops():
    x = torch.randn(5, 16) * 4
    w_q = torch.randint(-127, 128, (8, 16), dtype=torch.int8)
    w_scale = torch.rand(8) * 0.01
    bias = torch.randn(8)
    x[1, 3] = 90.0
    cases = [
        (torch.ops.llmnpu.quantize.default, (x, 0.05)),
        (torch.ops.llmnpu.dequantize.default, (K.quantize(x, 0.05), 0.05)),
        (torch.ops.llmnpu.int8_linear.default, (K.quantize(x, 0.05), 0.05, w_q, w_scale, bias)),
        (torch.ops.llmnpu.w8a8_linear.default, (x, 0.05, w_q, w_scale, bias)),
        (torch.ops.llmnpu.outlier_compensate.default, (torch.randn(5, 8), torch.randn(5, 2), torch.randn(2, 8))),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=("test_schema", "test_faketensor"))
    # data-dependent output size: the schema and fake checks only
    torch.library.opcheck(torch.ops.llmnpu.outlier_extract.default, (x, 3.0), test_utils=("test_schema",))


def test_ops_survive_torch_export():
    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("w_q", torch.randint(-127, 128, (8, 16), dtype=torch.int8))
            self.register_buffer("w_scale", torch.rand(8) * 0.01)

        def forward(self, x):
            return K.w8a8_linear(x, 0.05, self.w_q, self.w_scale, None)

    m = Lin()
    x = torch.randn(4, 16)
    ep = torch.export.export(m, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "llmnpu.w8a8_linear.default" in targets
    torch.testing.assert_close(ep.module()(x), m(x))


@pytest.mark.parametrize("form", ["default", "torch"])   # default: the native op where it is built
def test_fused_uint8_quantization_matches_the_quantize_op(form):
    from llmnpu_delegate.kernels import ops

    scale = 0.05
    halves = (torch.arange(-300, 301) + 0.5) * scale       # exact .5 steps: round-half-even must agree
    # 4,604 elements: not a multiple of a vector's 16, so the scalar tail runs too
    x = torch.cat([halves, torch.randn(4000) * 20, torch.tensor([1e6, -1e6, 0.0])]).reshape(2, -1)
    quantize = ops.quantize_u8 if form == "default" else ops.quantize_u8_torch
    want = (ops.quantize(x, scale).to(torch.int16) + 128).to(torch.uint8)
    assert torch.equal(quantize(x, scale), want)
    assert torch.equal(quantize(x.t().contiguous().t(), scale), want)   # strided input
    if form == "torch":
        assert ops._fused_state in ("ok", "failed")         # compiled where a compiler exists, else eager
    got = quantize(x, scale)
    assert int(got.min()) == 1 and int(got.max()) == 255    # symmetric: -128 is never produced


@pytest.mark.parametrize("form", ["default", "torch"])
def test_uint8_quantization_rounds_as_the_division_next_to_every_half(form):
    """The native op multiplies by 1/scale and divides only near a half (quantize_u8.cpp): each
    float within 4 ulps of every (k + 0.5) * scale, for scales whose reciprocal is inexact, must
    round as x / scale does. A product trusted everywhere gets 810 of these codes wrong."""
    from llmnpu_delegate.kernels import ops

    g = torch.Generator().manual_seed(0)
    quantize = ops.quantize_u8 if form == "default" else ops.quantize_u8_torch
    scales = [0.05, 1 / 3, 0.0123456, 7.77, 3e-5, *torch.rand(8, generator=g).add(1e-3).tolist(), 1e-39]
    for scale in scales:
        halves = ((torch.arange(-130, 130, dtype=torch.float64) + 0.5) * scale).float()
        near, up, down = [halves], halves, halves
        for _ in range(4):
            up, down = torch.nextafter(up, up + 1), torch.nextafter(down, down - 1)
            near += [up, down]
        x = torch.cat([*near, torch.randn(999, generator=g) * 40 * scale]).reshape(1, -1)
        want = (ops.quantize(x, scale).to(torch.int16) + 128).to(torch.uint8)
        assert torch.equal(quantize(x, scale), want), f"scale {scale}"


# tiny-llama: the op stays for the program's kernel (runner/ops/); gemma2: softcapping, decomposed
@pytest.mark.parametrize("spec, kept", [("random:tiny-llama", True), ("random:tiny-gemma2", False)])
def test_attention_subgraph_runs_in_executorch_as_the_engine_does(spec, kept):
    """A dynamic (attention) subgraph of chunk 2, exported with the chunk's real inputs, keeps our custom
    op where the program's kernel takes it (else ``decompositions()`` removes it) and runs in ExecuTorch
    with the engine's result, at that position and (the past length stays symbolic) at the first chunk's."""
    from executorch.exir import to_edge_transform_and_lower
    from executorch.extension.pybindings.portable_lib import (
        _load_for_executorch_from_buffer,
    )

    from llmnpu_delegate.lower.cpu_subgraphs import export_cpu_subgraph
    from llmnpu_delegate.models import load_model
    from llmnpu_delegate.runtime import program_ops
    from llmnpu_delegate.runtime.engine import Prefiller

    program_ops.load()

    engine = Prefiller(load_model(spec), chunk_len=16, quant=None, progress=False)
    program = engine.program
    with torch.no_grad():
        runs = list(program.run_in_order(engine.feeds(torch.randint(0, 1000, (40,)))))
    i = next(i for i, step in enumerate(program.steps) if not step.static)
    at = {c: (inputs, outs) for c, j, inputs, outs in runs if j == i}
    ep, _ = export_cpu_subgraph(engine.partition, program.steps[i].sub, None, "model.", tuple(at[2][0]), max_past=64)
    assert any(n.target is torch.ops.llmnpu.chunk_attention.default for n in ep.graph.nodes) == kept
    assert not any("llmnpu" in str(n.target) for n in ep.graph.nodes) or kept
    buffer = to_edge_transform_and_lower(ep).to_executorch().buffer
    pte = _load_for_executorch_from_buffer(buffer)
    for chunk in (2, 0):                                # a past of 32 tokens, then none
        inputs, outs = at[chunk]
        got = pte.forward(tuple(inputs))
        assert len(got) == len(outs)
        for g, want in zip(got, outs.values()):
            if isinstance(want, torch.Tensor):
                torch.testing.assert_close(g.to(want.dtype), want, rtol=1e-5, atol=1e-5)
            else:
                assert g == want        # a size the next subgraph reads
