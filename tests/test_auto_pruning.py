"""pruning_rate="auto": the rate comes from held-apart calibration text, and it is the highest grid
rate within the budget, checked by re-quantizing at that rate and the next one independently."""
import copy
import math

import pytest
import torch

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate, plan_linears, quantize_
from llmnpu_delegate.quantize.auto import GRID, chosen, mean_loss
from llmnpu_delegate.quantize.calibrate import calibration_samples, held_apart_windows


def test_held_apart_windows_never_overlap_calibration_samples():
    config = CalibConfig(samples=4, tokens=128, probe_tokens=128)
    ids = torch.arange(4096)                       # token i is position i: overlap is visible
    held = held_apart_windows(ids, config)
    seen = set(calibration_samples(ids, config).flatten().tolist())
    assert held.shape == (3, 256) and not seen & set(held.flatten().tolist())
    assert held_apart_windows(torch.arange(600), config) is None       # no gap wide enough


def test_auto_rate_is_the_highest_within_budget():
    from conftest import inject_outliers

    lm = load_model("random:tiny-llama")
    inject_outliers(lm.model)
    text = torch.randint(0, 1000, (4096,), generator=torch.Generator().manual_seed(1))
    calib = calibrate(lm.model, text, lm.fingerprint, CalibConfig(samples=4, tokens=128, probe_tokens=128),
                      progress=False)
    config = QuantConfig()
    assert config.pruning_rate == "auto"
    plans = plan_linears(lm.model, calib, config, lm.fingerprint, progress=False)
    choice = chosen(calib, config)
    rate = choice["rate"]
    assert sum(not p.shadow for p in plans.values()) == round(rate * len(plans))

    def loss_at(r):   # an independent path: quantize a copy at a fixed rate
        model = copy.deepcopy(lm.model)
        quantize_(model, calib, QuantConfig(pruning_rate=r), lm.fingerprint, progress=False)
        return mean_loss(model, calib.held_ids)

    limit = loss_at(0.0) + math.log1p(config.pruning_budget)
    assert loss_at(rate) <= limit + 1e-6
    following = [r for r in GRID if r > rate]
    if following:
        assert loss_at(following[0]) > limit - 1e-6
    assert choice["perplexity_ratio"] <= 1 + config.pruning_budget


def test_auto_needs_held_apart_text_and_bad_rates_are_refused():
    lm = load_model("random:tiny-llama")
    calib = calibrate(lm.model, torch.randint(0, 1000, (300,)), lm.fingerprint,
                      CalibConfig(samples=2, tokens=128, probe_tokens=128), progress=False)
    with pytest.raises(LlmNpuError, match="held-apart calibration text"):
        plan_linears(lm.model, calib, QuantConfig(), lm.fingerprint, progress=False)
    with pytest.raises(LlmNpuError, match="'auto' or lie in"):
        QuantConfig(pruning_rate="most")


def test_default_calibration_text_has_chat_formatted_samples(smollm2):
    from llmnpu_delegate.text import calibration_ids, read_text, tokenize

    ids = calibration_ids(smollm2)
    start = smollm2.tokenizer.convert_tokens_to_ids("<|im_start|>")
    plain = tokenize(smollm2, read_text(None, "calib"))
    assert int((ids == start).sum()) > 100 and int((plain == start).sum()) == 0
    assert ids.numel() > plain.numel()
