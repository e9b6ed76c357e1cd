"""bf16-operand attention (kernels/native/chunk_attention.cpp) against fp32 attention: the kernel's
contract, its fallbacks, its place in the engine, and the accuracy gate on the embedded model."""
import math

import pytest
import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.kernels import int8_path, native_ops
from llmnpu_delegate.kernels.attention import _attend, causal_mask, chunk_attention_bf16, resolve_precision
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate
from llmnpu_delegate.runtime.engine import Prefiller


def _cpu_has_avx512_bf16() -> bool:
    return int8_path.detect().has("avx512_bf16")     # the CPU as the project sees it (LLMNPU_CPU_ISA)


needs_bf16 = pytest.mark.skipif(not _cpu_has_avx512_bf16(), reason="this CPU has no AVX-512 BF16")


def sqnr(got: torch.Tensor, want: torch.Tensor) -> float:
    return 10 * math.log10(float(want.double().pow(2).sum() / (got.double() - want.double()).pow(2).sum()))


def _emulated(q, k, v, mask, scale):
    """The kernel's contract in float64: q * scale, k, v and the softmax numerators rounded to bf16;
    products, maximum, sum and output exact."""
    def bf16(x):
        return x.to(torch.bfloat16).double()
    g = q.shape[1] // k.shape[1]
    s = bf16(q * scale) @ bf16(k).repeat_interleave(g, 1).transpose(-1, -2)
    m = mask.reshape(s.shape[-2:])
    s = s.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else s + m.double()
    e = bf16((s - s.amax(-1, keepdim=True)).exp())
    return ((e @ bf16(v).repeat_interleave(g, 1)) / e.sum(-1, keepdim=True)).transpose(1, 2).float()


def test_the_kernel_runs_where_the_cpu_has_bf16():
    """A machine with AVX-512 BF16 must not silently fall back to fp32 attention."""
    assert native_ops.bf16_attention_available() == _cpu_has_avx512_bf16()


CASES = [  # heads, kv heads, chunk, past, head dim, mask
    (9, 3, 256, 0, 64, "causal"), (9, 3, 256, 768, 64, "causal"), (14, 2, 100, 37, 64, "causal"),
    (4, 4, 33, 5, 16, "causal"), (8, 2, 64, 130, 128, "causal"), (9, 3, 96, 200, 64, "window"),
    (9, 3, 96, 200, 64, "additive"), (9, 3, 96, 200, 64, "holes"),
]


@needs_bf16
@pytest.mark.parametrize("heads,kv_heads,chunk,past,dim,kind", CASES)
def test_bf16_attention_is_its_contract_and_not_fp32(heads, kv_heads, chunk, past, dim, kind):
    g = torch.Generator().manual_seed(heads * chunk + past)
    length = past + chunk
    q = 2 * torch.randn(1, heads, chunk, dim, generator=g)
    k = 2 * torch.randn(1, kv_heads, length, dim, generator=g)
    v = torch.randn(1, kv_heads, length, dim, generator=g)
    mask = causal_mask(chunk, length)
    if kind == "window":       # a sliding window of 40 keys: the kernel skips the tiles before it
        mask = mask & (torch.arange(length)[None, :] > torch.arange(past, length)[:, None] - 40)
    elif kind == "holes":      # keys hidden inside the causal span: the kernel reads this mask whole
        mask = mask & (torch.arange(length) % 7 != 3)[None, :]
    elif kind == "additive":
        mask = torch.where(mask, 0.0, float("-inf"))
    scale = dim ** -0.5
    got = chunk_attention_bf16(q, k, v, mask, scale, 0.0)
    fp32 = _attend(q, k, v, mask, scale, 0.0)
    boolean = mask if mask.dtype == torch.bool else mask == 0
    contract = _emulated(q, k, v, boolean, scale)
    effect = sqnr(got, fp32)            # what bf16 operands change: ~45 dB measured
    assert got.shape == fp32.shape == (1, chunk, heads, dim)
    assert effect < 70, "as close to fp32 as fp32 itself: the bf16 path did not run"
    # the kernel equals its contract to within a tenth of the bf16 effect (measured 87-141 dB)
    assert sqnr(got, contract) >= effect + 20



@needs_bf16
def test_bf16_attention_with_onednn_off_is_an_error_on_the_callers_thread():
    """oneDNN's brgemm refuses bf16 while oneDNN is off (ExecuTorch's Qualcomm quantizer turns it off
    on AMD hosts): the kernel says so before it splits into pieces, so a helper thread never meets
    the refusal (it aborted the process). With oneDNN back on, it runs."""
    assert native_ops.bf16_attention_available()      # loads the kernels
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 4, 64, 32, generator=g), torch.randn(1, 2, 64, 32, generator=g), \
        torch.randn(1, 2, 64, 32, generator=g)
    mask = causal_mask(64, 64)
    with torch.backends.mkldnn.flags(enabled=False):
        with pytest.raises(RuntimeError, match="oneDNN, which is off"):
            native_ops.chunk_attention_bf16(q, k, v, mask, 0.125)
    assert sqnr(native_ops.chunk_attention_bf16(q, k, v, mask, 0.125), _attend(q, k, v, mask, 0.125, 0.0)) > 30


@needs_bf16
def test_bf16_attention_is_the_same_bits_on_any_number_of_threads():
    """The kernel's pieces (packing ranges, (KV head, row block) pairs) run on whichever thread takes
    them (lane help, or torch's threads): each writes only its own outputs, so the bits cannot depend
    on the split. Long enough for several packing ranges and row blocks per head."""
    g = torch.Generator().manual_seed(11)
    q, k, v = torch.randn(1, 9, 256, 64, generator=g), torch.randn(1, 3, 900, 64, generator=g), \
        torch.randn(1, 3, 900, 64, generator=g)
    mask = causal_mask(256, 900)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = native_ops.chunk_attention_bf16(q, k, v, mask, 0.125)
        torch.set_num_threads(2)
        two = native_ops.chunk_attention_bf16(q, k, v, mask, 0.125)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(one, two)
    assert sqnr(one, _attend(q, k, v, mask, 0.125, 0.0)) < 70     # the bf16 kernel ran

def test_bf16_attention_falls_back_to_fp32_where_the_kernel_does_not_apply():
    q, k, v = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16), torch.randn(1, 2, 8, 16)
    mask = causal_mask(8, 8)
    softcapped = chunk_attention_bf16(q, k, v, mask, 0.25, 30.0)
    assert torch.equal(softcapped, _attend(q, k, v, mask, 0.25, 30.0))
    per_head = mask.expand(1, 4, 8, 8).clone()
    per_head[:, 1, :, 0] = False
    assert torch.equal(chunk_attention_bf16(q, k, v, per_head, 0.25, 0.0), _attend(q, k, v, per_head, 0.25, 0.0))


@needs_bf16
def test_bf16_attention_refuses_what_it_cannot_compute():
    q, k = torch.randn(1, 4, 8, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="float32"):
        native_ops.chunk_attention_bf16(q.double(), k.double(), k.double(), causal_mask(8, 8), 0.25)
    with pytest.raises(RuntimeError, match="mask"):
        native_ops.chunk_attention_bf16(q, k, k, causal_mask(8, 9), 0.25)


def test_precision_choice():
    assert resolve_precision("auto", quantized=False) == "fp32"     # the float reference stays fp32
    assert resolve_precision("auto", quantized=True) == ("bf16" if native_ops.bf16_attention_available() else "fp32")
    assert resolve_precision("fp32", quantized=True) == "fp32"
    with pytest.raises(LlmNpuError, match="unknown attention precision"):
        resolve_precision("fp8", quantized=True)



# ------------------------------------------------------------------------------------- in the engine
@pytest.fixture(scope="module")
def tiny():
    return load_model("random:tiny-llama")


@needs_bf16
def test_engine_attention_runs_in_bf16_within_its_effect(tiny):
    """The float engine with bf16 attention and LM-head weights against the same engine in fp32: close
    (the bf16 effect only) but not equal (the kernels really run); norms, RoPE and the gated
    activation are fused in both."""
    ids = torch.randint(0, 1000, (70,), generator=torch.Generator().manual_seed(3))
    ref = Prefiller(tiny, 16, quant=None, cache=GraphCache(), progress=False)
    bf16 = Prefiller(tiny, 16, quant=None, cache=GraphCache(), progress=False, attention="bf16")
    assert (ref.attention, bf16.attention) == ("fp32", "bf16")
    targets = {n.target for s in bf16.program.steps if s.sub.kind != "npu" for n in s.fn.graph.nodes}
    assert {chunk_attention_bf16, native_ops.rms_norm, native_ops.silu_mul_, native_ops.rope,
            native_ops.linear_bf16w} <= targets                 # the head's weights too
    assert torch.ops.aten.rsqrt.default not in targets          # every llama norm was fused
    assert torch.ops.aten.silu.default not in targets
    want, got = ref(ids), bf16(ids)
    assert 40 <= sqnr(got.logits, want.logits) < 90
    assert min(sqnr(a, b) for a, b in zip(got.past_k, want.past_k)) >= 40


@needs_bf16
def test_quantized_engines_choose_bf16_attention(tiny):
    calib = calibrate(tiny.model, torch.randint(0, 1000, (256,)), tiny.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    engine = Prefiller(tiny, 16, quant=QuantConfig(pruning_rate=0.5), calibration=calib, cache=GraphCache(),
                       progress=False)
    assert engine.attention == "bf16"


# ------------------------------------------------------------------------------ the accuracy gate
def _bf16_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, softcap=None, **_):
    mask = attention_mask if attention_mask is not None else causal_mask(query.shape[2], key.shape[2])
    return chunk_attention_bf16(query, key, value, mask, float(scaling or query.shape[-1] ** -0.5),
                                float(softcap or 0.0)), None


AttentionInterface.register("llmnpu-bf16-test", _bf16_attention)
ALL_MASK_ATTENTION_FUNCTIONS.register("llmnpu-bf16-test", sdpa_mask)


@pytest.mark.slow
@needs_bf16
def test_bf16_attention_keeps_the_embedded_model_within_40_db_and_its_perplexity(smollm2):
    """The issue's gate: logits SQNR against fp32 attention >= 40 dB and perplexity within 0.1 %, on
    two 1,024-token windows of evaluation text, the float model otherwise unchanged (measured:
    48 dB, +0.02 %). In the INT8 engine the same change moves the logits by about the INT8 noise
    itself (roundings flip), so the gate isolates what attention's precision does."""
    from llmnpu_delegate.text import read_text, tokenize

    ids = tokenize(smollm2, read_text(None, "eval"))[:2048].view(2, 1024)
    model, before = smollm2.model, smollm2.model.config._attn_implementation
    results = {}
    try:
        for name in ("llmnpu", "llmnpu-bf16-test"):      # "llmnpu": the fp32 chunk attention op
            model.config._attn_implementation = name
            with torch.inference_mode():
                logits = torch.cat([model(w[None], use_cache=False).logits[0] for w in ids])
            nll = torch.nn.functional.cross_entropy(
                logits.view(2, 1024, -1)[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
            results[name] = logits, math.exp(float(nll))
    finally:
        model.config._attn_implementation = before
    (ref, ppl_ref), (got, ppl) = results["llmnpu"], results["llmnpu-bf16-test"]
    db = [sqnr(got[1024 * w:1024 * (w + 1)], ref[1024 * w:1024 * (w + 1)]) for w in range(2)]
    print(f"bf16 attention: logits SQNR {db[0]:.1f} / {db[1]:.1f} dB, perplexity {ppl:.4f} vs {ppl_ref:.4f}")
    assert all(40 <= d < 90 for d in db)
    assert abs(ppl / ppl_ref - 1) <= 0.001, (ppl, ppl_ref)
