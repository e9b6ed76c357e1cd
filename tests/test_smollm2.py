"""The embedded model end to end: the facts the whole project rests on (slow: loads 135M weights)."""
import copy

import pytest
import torch

from llmnpu_delegate.evaluate import eval_windows, perplexity, read_text, tokenize
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate, outlier_counters, quantize_

pytestmark = pytest.mark.slow


def test_embedded_model_greedy_paris(smollm2):
    tok = smollm2.tokenizer
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        p = smollm2.model(input_ids=ids).logits[0, -1].softmax(-1)
    assert tok.decode(p.argmax()) == " Paris" and p.max() > 0.5


def test_shadow_execution_on_real_outliers(smollm2):
    """Calibrate on news, evaluate on Wikipedia: shadow W8A8 stays near fp32 where naive W8A8 does not."""
    calib_ids = tokenize(smollm2, read_text(None, "calib"))
    eval_ids = tokenize(smollm2, read_text(None, "eval"))
    calib = calibrate(smollm2.model, calib_ids, smollm2.fingerprint, CalibConfig(samples=4, tokens=256), progress=False)
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
    assert ppl["shadow"] < 1.02 * fp32, (fp32, ppl)
    assert ppl["none"] > 1.5 * fp32, (fp32, ppl)
