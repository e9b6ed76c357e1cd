"""The embedded model end to end: the facts the whole project rests on (slow: loads 135M weights)."""
import copy

import pytest
import torch
from conftest import on_int64

from llmnpu_delegate.evaluate import eval_windows, perplexity
from llmnpu_delegate.quantize import QuantConfig, outlier_counters, quantize_
from llmnpu_delegate.text import read_text, tokenize

pytestmark = pytest.mark.slow


def test_embedded_model_greedy_paris(smollm2):
    tok = smollm2.tokenizer
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        p = smollm2.model(input_ids=ids).logits[0, -1].softmax(-1)
    assert tok.decode(p.argmax()) == " Paris" and p.max() > 0.5


def test_shadow_execution_on_real_outliers(smollm2):
    """Calibrate on news (the default calibration, shared by the session), evaluate on Wikipedia:
    shadow W8A8 stays near fp32 where naive W8A8 does not."""
    from llmnpu_delegate.prepare import default_calibration

    eval_ids = tokenize(smollm2, read_text(None, "eval"))
    calib = default_calibration(smollm2, False)
    # real outliers: the largest linear inputs are far beyond their 99.5th percentile
    ratios = {n: s.absmax / s.percentiles[99.5] for n, s in calib.layers.items()}
    assert max(ratios.values()) > 100 and "down_proj" in max(ratios, key=ratios.get)
    windows = eval_windows(eval_ids, 256, 1024)
    fp32 = perplexity(smollm2.model, windows, progress=False)
    ppl = {}
    for mode in ("none", "shadow"):
        m = copy.deepcopy(smollm2.model)
        quantize_(m, calib, QuantConfig(outliers=mode, pruning_rate=0.0), smollm2.fingerprint, progress=False)
        ppl[mode] = perplexity(m, windows, progress=False)
        if mode == "shadow":
            c = outlier_counters(m)
            assert c["outlier_elements"] / c["seen_elements"] < 0.01
            _assert_every_linear_is_int64_arithmetic(m, smollm2.model, eval_ids[None, :64])
    assert ppl["shadow"] < 1.02 * fp32, (fp32, ppl)
    assert ppl["none"] > 1.5 * fp32, (fp32, ppl)


def _assert_every_linear_is_int64_arithmetic(quantized, model, ids):
    """Each quantized linear, on its real input (real outliers), equals itself with its INT8 GEMM in
    int64: on this CPU's kernel, the same integers; the epilogue's float rounding may differ by an ulp.
    Checked per linear: across 30 layers, activations of ~25,000 turn such an ulp into different
    quantization steps downstream, which would hide the kernel under the cascade."""
    from llmnpu_delegate.quantize.linear import QuantLinear

    inputs, floats = {}, dict(model.named_modules())
    linears = {n: mod for n, mod in quantized.named_modules() if isinstance(mod, QuantLinear)}
    hooks = [mod.register_forward_pre_hook(lambda _m, args, n=n: inputs.setdefault(n, args[0].detach()))
             for n, mod in linears.items()]
    with torch.no_grad():
        quantized(ids)
    for h in hooks:
        h.remove()
    assert len(inputs) == len(linears) == 210
    for name, mod in linears.items():
        x = inputs[name]
        with torch.no_grad():
            got, want = mod(x), on_int64(mod, x)
            effect = float((want - floats[name](x)).abs().max())
        assert effect > 0 and float((got - want).abs().max()) <= effect / 1000, name


def test_chunked_prefill_on_the_embedded_model(smollm2):
    """Real text, real outliers, chunk 256: float equals HF; W8A8 + shadow equals the unchunked quantized
    model and predicts the float model's next token."""
    from llmnpu_delegate.runtime.engine import Prefiller

    ids = tokenize(smollm2, read_text(None, "eval"))[:600]
    with torch.no_grad():
        want = smollm2.model(ids[None]).logits[0, -1]
    result = Prefiller(smollm2, 256, quant=None)(ids)
    assert result.chunks == 3
    torch.testing.assert_close(result.logits, want, atol=2e-3, rtol=1e-3)

    from llmnpu_delegate.prepare import default_calibration

    calib = default_calibration(smollm2, False)
    # a fixed pruning by the paper's ranking: an automatic one is chosen by timing this machine's engine
    config = QuantConfig(importance="ratio", pruning_rate=0.2)
    # fp32 attention: the yardstick below is a float-level change (bf16 attention is gated on its own)
    engine = Prefiller(smollm2, 256, quant=config, calibration=calib, progress=False, attention="fp32")
    got = engine(ids).logits
    reference = copy.deepcopy(smollm2.model)
    quantize_(reference, calib, config, smollm2.fingerprint, progress=False)
    with torch.no_grad():
        ref = reference(ids[None]).logits[0, -1]
        # With activations of ~25,000, a float-level change anywhere (here: transformers' other
        # attention implementation) flips some roundings and moves the quantized logits: that is
        # the yardstick. Chunked prefill must stay within it (tiny models agree to 1e-6).
        reference.config._attn_implementation = "eager"
        ref_eager = reference(ids[None]).logits[0, -1]
    noise = float((ref - ref_eager).abs().max())
    assert 0 < noise < 10
    assert float((got - ref).abs().max()) < 2 * noise
    assert int(got.argmax()) == int(ref.argmax()) == int(want.argmax())
