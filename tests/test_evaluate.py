"""The accuracy harness and the CLI on tiny models; text preparation on a markup sample."""
import json
import subprocess
import sys

import pytest
import torch

from llmnpu_delegate import LlmNpuError
from llmnpu_delegate.cli import main
from llmnpu_delegate.evaluate import eval_windows, perplexity, window_scores
from llmnpu_delegate.models import load_model
from llmnpu_delegate.text import read_text


def test_eval_windows():
    ids = torch.arange(1000)
    w = eval_windows(ids, 100, 250)
    assert w.shape == (3, 100) and torch.equal(w.flatten(), ids[:300])
    assert eval_windows(ids, 100, 10**6).shape == (10, 100)
    with pytest.raises(LlmNpuError, match="fewer than one window"):
        eval_windows(torch.arange(50), 100, 100)
    with pytest.raises(LlmNpuError, match="max tokens must be positive"):
        eval_windows(ids, 100, 0)


def test_perplexity_matches_hf_loss():
    lm = load_model("random:tiny-llama")
    ids = torch.randint(0, 3000, (2, 40))
    with torch.no_grad():
        losses = [lm.model(input_ids=r[None], labels=r[None]).loss for r in ids]
    assert perplexity(lm.model, ids, progress=False) == pytest.approx(float(torch.stack(losses).mean().exp()), rel=1e-4)


def test_logits_sqnr_is_executorchs_over_all_windows_at_once():
    """The SQNR column is torchao's compute_error (ExecuTorch's sqnr_eval) of the concatenated logits,
    not a mean of per-window decibels: one window here is far noisier than the other."""
    import copy

    from torchao.quantization.utils import compute_error

    lm = load_model("random:tiny-llama")
    noisy = copy.deepcopy(lm.model)
    with torch.no_grad():
        for p in noisy.parameters():
            p.add_(0.05 * torch.randn_like(p) * p.abs().mean())
    ids = torch.randint(0, 3000, (2, 40), generator=torch.Generator().manual_seed(3))
    ids[1] = ids[1].flip(0)
    got = window_scores(noisy, ids, progress=False, reference=lm.model)
    with torch.no_grad():
        ref = torch.cat([lm.model(input_ids=r[None]).logits[0] for r in ids]).double()
        out = torch.cat([noisy(input_ids=r[None]).logits[0] for r in ids]).double()
        per_window = [float(compute_error(ref[i * 40:(i + 1) * 40], out[i * 40:(i + 1) * 40])) for i in range(2)]
    pooled = float(compute_error(ref, out))
    assert got["logits_sqnr_db"] == pytest.approx(pooled, abs=1e-6)
    assert abs(sum(per_window) / 2 - pooled) > 1e-4      # what a mean of decibels would have given
    assert got["ppl"] == perplexity(noisy, ids, progress=False) and 5 < pooled < 60
    assert window_scores(lm.model, ids, progress=False, reference=lm.model)["logits_sqnr_db"] == float("inf")


def test_the_peak_piece_scores_the_norm_readers_products_over_their_peak_channels():
    """Placement piece ``peak`` in the harness: the shadow products of q/k/v and gate/up restricted to
    their calibrated peak channels, o_proj's and down_proj's untouched. The injected outliers sit on
    two channels of each input norm, so two peak channels must hold q/k/v's product: the logits stay
    within a tenth of what dropping those products entirely moves them."""
    from conftest import outlier_model

    from llmnpu_delegate.evaluate import quantized_model
    from llmnpu_delegate.placed_numerics import apply_placement, peak_products
    from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate
    from llmnpu_delegate.quantize.linear import QuantLinear

    lm = outlier_model()
    calib = calibrate(lm.model, torch.randint(0, 1000, (256,)), lm.fingerprint,
                      CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    quant = QuantConfig(outliers="shadow", pruning_rate=0.0)
    ids = torch.randint(0, 1000, (1, 48), generator=torch.Generator().manual_seed(3))

    def logits(count=None):
        model, _ = quantized_model(lm, quant, calib, progress=False)
        if count is not None:
            peak_products(lm, model, calib, count)
        with torch.inference_mode():
            return model, model(input_ids=ids).logits[0].float()

    engine, every = logits()
    _, two = logits(2)
    _, none = logits(0)
    assert (two - every).abs().max() < 0.1 * (none - every).abs().max()
    model, _ = quantized_model(lm, quant, calib, progress=False)
    assert apply_placement(lm, model, "peak", calib=calib) == {"placement": "peak", "peak_products": 10}
    kept = {n: m.shadow_channels for n, m in model.named_modules() if isinstance(m, QuantLinear)
            and m.shadow_channels is not None}
    assert sorted({n.rsplit(".", 1)[-1] for n in kept}) == ["gate_proj", "k_proj", "q_proj", "up_proj", "v_proj"]
    assert all(len(c) <= 32 for c in kept.values())
    assert all({3, 17} <= set(c.tolist()) for n, c in kept.items() if n.endswith("q_proj"))


def test_read_text_errors(tmp_path):
    (tmp_path / "empty.txt").write_text("  \n")
    with pytest.raises(LlmNpuError, match="empty"):
        read_text(tmp_path / "empty.txt", "eval")
    with pytest.raises(LlmNpuError, match="not found"):
        read_text(tmp_path / "nope.txt", "eval")


def _words(n):
    base = "the quick brown fox jumps over the lazy dog while a river runs past old stone houses".split()
    return " ".join(base[i % len(base)] for i in range(n))


def test_cli_eval_json(tmp_path, capsys):
    (tmp_path / "e.txt").write_text(_words(600))
    (tmp_path / "c.txt").write_text(_words(900))
    rc = main(["eval", "--model", "random:tiny-llama", "--text-file", str(tmp_path / "e.txt"),
               "--calib-text-file", str(tmp_path / "c.txt"), "--max-tokens", "120", "--window", "32",
               "--calib-samples", "2", "--calib-tokens", "64", "--no-progress", "--json"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["model"] == "random:tiny-llama" and out["window"] == 32 and out["tokens"] >= 120
    assert set(out["results"]) == {"fp32", "w8a8", "smoothquant", "w8a8-shadow", "w8a8-shadow-pruned",
                                   "w8a8-shadow-tensorw"}
    for mode, r in out["results"].items():
        assert r["ppl"] > 1
        if "shadow" in mode:
            assert 0 <= r["outlier_fraction"] < 0.05
    # the default rate is "auto": the report gives the share of paths it chose to prune
    assert 0.0 <= out["results"]["w8a8-shadow-pruned"]["pruning_rate"] <= 1.0


def test_cli_eval_scores_each_placement_of_each_quantization_mode(tmp_path, capsys):
    """A row per placement of each quantization mode, the float model once. Attention and the norms
    change what a placement computes (16-bit grids on the NPU); RoPE and the gated activation score as
    the paper's split."""
    (tmp_path / "e.txt").write_text(_words(600))
    args = ["eval", "--model", "random:tiny-llama", "--text-file", str(tmp_path / "e.txt"), "--max-tokens", "120",
            "--window", "32", "--calib-samples", "2", "--calib-tokens", "64", "--no-progress",
            "--modes", "fp32", "w8a8-shadow", "--pruning-rate", "0"]
    assert main([*args, "--placement", "paper", "norms", "rope+act", "attention-half", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert list(rows) == ["fp32", "w8a8-shadow", "w8a8-shadow@norms", "w8a8-shadow@rope+act",
                          "w8a8-shadow@attention-half"]
    assert rows["w8a8-shadow@rope+act"]["ppl"] == rows["w8a8-shadow"]["ppl"]
    # the norms' grids cost little (measured: 48,291.8 against 48,288.8 on this random model)
    assert rows["w8a8-shadow@norms"]["ppl"] != rows["w8a8-shadow"]["ppl"]
    assert rows["w8a8-shadow@norms"]["ppl"] == pytest.approx(rows["w8a8-shadow"]["ppl"], rel=1e-3)
    npu = rows["w8a8-shadow@attention-half"]
    assert npu["ppl"] != rows["w8a8-shadow"]["ppl"] and npu["npu_kv_bits"] == 16
    assert npu["placement"] == "attention-half" and "npu_kv_bits" not in rows["w8a8-shadow@norms"]
    assert main([*args, "--placement", "block", "peak", "--npu-kv-bits", "8"]) == 0
    out = capsys.readouterr().out
    assert "w8a8-shadow@block" in out and "K/V window at 8 bits" in out
    assert "w8a8-shadow@peak" in out and "shadow products over their 32 peak input channels only" in out
    assert main([*args, "--placement", "norms", "--npu-kv-bits", "8"]) == 2
    assert "--npu-kv-bits sets the K/V window of attention on the NPU" in capsys.readouterr().err
    assert main([*args[:-5], "--modes", "fp32", "--placement", "block"]) == 2
    assert "--placement applies to the quantization modes" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*args, "--placement", "wings"])
    assert "unknown placement 'wings'" in capsys.readouterr().err


def test_cli_errors_are_one_line(tmp_path):
    (tmp_path / "short.txt").write_text("too short")
    cmd = [sys.executable, "-m", "llmnpu_delegate.cli", "eval", "--model", "random:tiny-llama",
           "--text-file", str(tmp_path / "short.txt"), "--modes", "fp32", "--no-progress"]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "fewer than one window" in r.stderr
    r = subprocess.run([sys.executable, "-m", "llmnpu_delegate.cli", "eval", "--model", "no-such-model"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "unknown model 'no-such-model'" in r.stderr


def test_wiki_markup_to_prose():
    from llmnpu_delegate.text import wiki_to_prose

    markup = ("{{Infobox|name=x|{{nested}}}}\n'''Anarchism''' is a [[political philosophy]] that "
              "[[advocacy|advocates]] self-governed societies<ref>cite</ref> based on voluntary "
              "institutions, and it has been described in many ways by many different authors over time.\n"
              "== History ==\n* a list item that is not prose at all\n[[Category:Things]]")
    assert wiki_to_prose(markup) == [
        "Anarchism is a political philosophy that advocates self-governed societies based on voluntary "
        "institutions, and it has been described in many ways by many different authors over time."]


def test_cli_calibrate_json(tmp_path, capsys):
    (tmp_path / "c.txt").write_text(_words(900))
    out_path = tmp_path / "calib.pt"
    rc = main(["calibrate", "--model", "random:tiny-qwen2", "--calib-text-file", str(tmp_path / "c.txt"),
               "--calib-samples", "2", "--calib-tokens", "64", "--out", str(out_path), "--no-progress", "--json"])
    assert rc == 0 and out_path.is_file()
    out = json.loads(capsys.readouterr().out)
    assert out["artefact"] == str(out_path) and len(out["layers"]) == 2 * 7  # 2 blocks x q,k,v,o,gate,up,down
    for stats in out["layers"].values():
        assert stats["absmax"] >= stats["p99.5"] > 0


def test_cli_sweep_is_monotone(tmp_path, capsys):
    (tmp_path / "e.txt").write_text(_words(400))
    (tmp_path / "c.txt").write_text(_words(900))
    rc = main(["eval", "--model", "random:tiny-gemma", "--text-file", str(tmp_path / "e.txt"),
               "--calib-text-file", str(tmp_path / "c.txt"), "--max-tokens", "60", "--window", "32",
               "--calib-samples", "2", "--calib-tokens", "64", "--no-progress", "--json",
               "--modes", "fp32", "--sweep", "--placement", "paper", "attention+rope"])
    assert rc == 0
    every = json.loads(capsys.readouterr().out)["sweep"]
    rows = [r for r in every if r["placement"] == "paper"]
    # each point again with attention on the NPU: the same shadow paths, other numerics (on this
    # random model its 16-bit encodings move the perplexity in the 5th digit, at 7 points of 9)
    placed = [r for r in every if r["placement"] == "attention+rope"]
    assert [(r["clip_percentile"], r["pruning_rate"], r["shadow_layers"]) for r in placed] == \
        [(r["clip_percentile"], r["pruning_rate"], r["shadow_layers"]) for r in rows]
    assert any(a["ppl"] != b["ppl"] for a, b in zip(rows, placed)) and len(every) == 2 * len(rows)
    # Gemma's norms scale by (1 + w): no NPU form, refused in one line
    rc = main(["eval", "--model", "random:tiny-gemma", "--text-file", str(tmp_path / "e.txt"), "--max-tokens", "60",
               "--window", "32", "--no-progress", "--modes", "w8a8", "--placement", "norms"])
    assert rc == 2 and "gemma's norms scale by (1 + w)" in capsys.readouterr().err
    clip_rows = [r for r in rows if r["pruning_rate"] == 0.0]
    prune_rows = [r for r in rows if r["pruning_rate"] > 0]
    assert [r["clip_percentile"] for r in clip_rows] == [99.0, 99.5, 99.9, 99.99]
    fractions = [r["outlier_fraction"] for r in clip_rows]
    assert fractions == sorted(fractions, reverse=True) and fractions[0] > fractions[-1]
    assert [r["pruning_rate"] for r in prune_rows] == [0.5, 0.7, 0.85, 0.95, 1.0]
    assert [r["shadow_layers"] for r in prune_rows] == sorted((r["shadow_layers"] for r in prune_rows), reverse=True)
    assert prune_rows[-1]["shadow_layers"] == 0 and prune_rows[-1]["outlier_fraction"] == 0.0


def test_shipped_texts_are_disjoint():
    """The default calibration (news) and evaluation (Wikipedia) texts share no paragraph and no
    long word sequence, so the accuracy numbers are on text calibration never saw."""
    calib = read_text(None, "calib").split("\n\n")
    evalt = read_text(None, "eval").split("\n\n")
    assert len(" ".join(calib).split()) > 50_000 and len(" ".join(evalt).split()) > 300_000
    assert not set(calib) & set(evalt)

    def grams(paras, n=12):
        out = set()
        for p in paras:
            w = p.split()
            out.update(tuple(w[i:i + n]) for i in range(len(w) - n + 1))
        return out

    assert not grams(calib) & grams(evalt[:1000])


def test_cli_clip_percentile_must_be_calibrated(tmp_path, capsys):
    (tmp_path / "e.txt").write_text(_words(300))
    (tmp_path / "c.txt").write_text(_words(600))
    common = ["eval", "--model", "random:tiny-llama", "--text-file", str(tmp_path / "e.txt"),
              "--calib-text-file", str(tmp_path / "c.txt"), "--max-tokens", "40", "--window", "32",
              "--calib-samples", "2", "--calib-tokens", "64", "--no-progress", "--json", "--modes", "w8a8-shadow",
              "--clip-percentile", "98"]
    assert main(common) == 2
    assert "--calib-percentiles" in capsys.readouterr().err
    assert main(common + ["--calib-percentiles", "98", "99.5"]) == 0
    assert json.loads(capsys.readouterr().out)["results"]["w8a8-shadow"]["clip_percentile"] == 98.0


def test_the_table_keeps_a_broken_modes_columns_apart():
    """A perplexity of hundreds of thousands (8-bit activations without outlier handling) and its
    ratio stay separate columns."""
    from llmnpu_delegate.cli.eval import format_eval

    text = format_eval({"model": "m", "tokens": 10, "window": 5,
                        "results": {"fp32": {"ppl": 23.0}, "broken": {"ppl": 357464.141, "logits_sqnr_db": -5.6}}})
    row = next(line for line in text.splitlines() if line.startswith("broken"))
    assert row.split()[1:4] == ["3.575e+05", "15541.919x", "-5.6"], row
