"""Quantization stage: weight math, the shadow linear's exact equation, hot channels, calibration,
the artefact, pruning, and quantize_ over every supported family."""
import gc
import json
import weakref

import numpy as np
import pytest
import torch
from conftest import TINY_CHUNK, outlier_model

from llmnpu_delegate import LlmNpuError
from llmnpu_delegate.format.rows import ColdRows
from llmnpu_delegate.models import RANDOM_SHAPES, load_model
from llmnpu_delegate.paths import load_checked, save_checked
from llmnpu_delegate.quantize.importance import importance_key
from llmnpu_delegate.quantize import (
    CalibConfig,
    Calibration,
    QuantConfig,
    QuantLinear,
    calibrate,
    outlier_counters,
    quantizable_linears,
    quantize_,
    quantize_weight,
)
from llmnpu_delegate.quantize.importance import layers_to_prune
from llmnpu_delegate.quantize.shadow_rows import hot_channels, peak_channels, rows_files, shadow_rows

TINY = [s for s in RANDOM_SHAPES if s.startswith("tiny-")]


def fake_quant(x, scale):
    return torch.clamp(torch.round(x / scale), -127, 127) * scale


# --------------------------------------------------------------------------- weights
@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_quantize_weight_roundtrip(granularity):
    w = torch.randn(32, 48)
    w[5] *= 40  # one large row: per-tensor scales suffer, per-channel do not
    q, s = quantize_weight(w, granularity)
    assert q.dtype == torch.int8 and s.shape == (32,)
    err = (q.float() * s[:, None] - w).abs()
    assert (err <= s[:, None] / 2 + 1e-6).all()
    if granularity == "tensor":
        assert torch.all(s == s[0])
    else:
        assert torch.allclose(s, w.abs().amax(1) / 127)


# --------------------------------------------------------------------------- shadow linear
def _shadow_layer(tmp_path, w, b, clip, hot):
    w_q, w_s = quantize_weight(w, "channel")
    store = shadow_rows(tmp_path.name, "w", w, torch.tensor(hot, dtype=torch.int64))  # a model per test
    layer = QuantLinear(w_q, w_s, b, clip / 127, full_scale=50.0 / 127, clip=clip, shadow=store)
    return layer, w_q, w_s, store


def _outliers_in_channels_5_11_30(seed: int):
    """(w, b, x, clip): a [24, 40] linear and inputs within +-2.5 but for four outliers beyond the clip 3."""
    torch.manual_seed(seed)
    w, b = torch.randn(24, 40) * 0.1, torch.randn(24)
    x = torch.randn(2, 9, 40).clamp(-2.5, 2.5)
    x[0, 3, 5], x[1, 2, 5], x[1, 7, 30], x[0, 0, 11] = 40.0, -25.0, 33.0, 12.0
    return w, b, x, 3.0


def test_shadow_linear_equals_clipped_int8_plus_float_residue(tmp_path):
    w, b, x, clip = _outliers_in_channels_5_11_30(1)
    layer, w_q, w_s, store = _shadow_layer(tmp_path, w, b, clip, hot=[5])
    y = layer(x)
    # the equation, written with plain float ops
    x_clip = x.clamp(-clip, clip)
    ref = fake_quant(x_clip, clip / 127) @ (w_q.float() * w_s[:, None]).t() + b + (x - x_clip) @ w.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # channel 5 is hot, 11 and 30 are read from disk
    assert store.cold_fetches == 2 and store.hot_hits == 1
    assert layer.outlier_elements == 4 and layer.seen_elements == x.numel()


def test_a_static_channel_set_takes_only_its_channels_residues(tmp_path):
    w, b, x, clip = _outliers_in_channels_5_11_30(2)
    layer, w_q, w_s, _ = _shadow_layer(tmp_path, w, b, clip, hot=[5])
    layer.shadow_channels = torch.tensor([5, 30])
    y = layer(x)
    x_clip = x.clamp(-clip, clip)
    residue = torch.zeros_like(x)
    residue[..., [5, 30]] = (x - x_clip)[..., [5, 30]]
    ref = fake_quant(x_clip, clip / 127) @ (w_q.float() * w_s[:, None]).t() + b + residue @ w.t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    # the restriction is seen: channel 11's residue would move the output by far more than the tolerance
    assert ((12.0 - clip) * w[:, 11]).abs().max() > 100 * 1e-4
    assert layer.outlier_elements == 3


def test_peak_channels_rank_the_clipped_peak_by_its_weight_column():
    absmax = torch.tensor([1.0, 10.0, 4.0, 30.0, 2.0])
    w = torch.ones(3, 5)
    w[:, 3] = 0.01      # the highest peak, on a column that barely reaches the output
    assert peak_channels(absmax, 3.0, w, 2).tolist() == [1, 2]
    assert peak_channels(absmax, 3.0, w, 5).tolist() == [1, 2, 3]     # channels within the clip never
    assert peak_channels(absmax, 50.0, w, 2).numel() == 0


def test_pruned_layer_uses_full_range_never_clips(tmp_path):
    w, b = torch.randn(16, 20) * 0.1, None
    x = torch.randn(5, 20)
    x[2, 3] = 45.0
    layer, w_q, w_s, _ = _shadow_layer(tmp_path, w, b, clip=3.0, hot=[])
    layer.pruned = True
    y = layer(x)
    ref = fake_quant(x, 50.0 / 127) @ (w_q.float() * w_s[:, None]).t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    clipped = fake_quant(x.clamp(-3, 3), 3 / 127) @ (w_q.float() * w_s[:, None]).t()
    exact = x @ w.t()
    # the outlier survives (full range) where clipping would lose most of it
    assert (y - exact).abs().max() < 0.5 * (clipped - exact).abs().max()
    assert layer.saturated_elements == 0
    x[0, 0], x[4, 9] = 80.0, -51.0  # beyond the calibrated full range (50): saturates, and is counted
    layer(x)
    assert layer.saturated_elements == 2


def test_hot_channels_cover_requested_share():
    counts = torch.tensor([0, 50, 3, 30, 10, 7])
    hot = hot_channels(counts, 0.8)
    assert hot.tolist() == [1, 3]  # 80 of 100 hits
    assert hot_channels(counts, 0.81).tolist() == [1, 3, 4]
    assert hot_channels(torch.zeros(4, dtype=torch.int64), 0.8).numel() == 0


def test_shadow_rows_hot_in_ram_cold_from_the_rows_file(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    w = torch.randn(6, 9)
    store = shadow_rows("fp", "layer.0", w, torch.tensor([2, 7]))
    rows, desc = rows_files("fp", "layer.0", torch.tensor([2, 7]))
    assert rows.stat().st_size == 7 * 6 * 4             # the 7 cold channels' rows only: hot ones live in RAM
    torch.testing.assert_close(store.rows(torch.tensor([1, 2, 7, 8])), w.t()[[1, 2, 7, 8]])
    assert store.cold_fetches == 2 and store.hot_hits == 2
    # counted when read, and in batches: reads in between, a batch closing mid-way and a reset agree
    store.COUNT_EVERY = 3
    for i in range(7):
        store.rows(torch.tensor([2, 7, i]))        # 2 and 7 hot; i hot only when 2
        if i == 4:
            assert (store.cold_fetches, store.hot_hits) == (2 + 4, 2 + 2 * 5 + 1)
    assert (store.cold_fetches, store.hot_hits) == (2 + 6, 2 + 2 * 7 + 1)
    store.reset_counts()
    store.rows(torch.tensor([0]))
    assert (store.cold_fetches, store.hot_hits) == (1, 0)
    assert store.resident_bytes == 2 * 6 * 4
    assert not [p for p in rows.parent.iterdir() if p.name.startswith(".")]  # no temporary left behind
    # the same rows file layout as a program's: its description reads like a sidecar's shadow entry
    assert ColdRows(rows, json.loads(desc.read_text())).stores["layer.0"].cold.tolist() == [0, 1, 3, 4, 5, 6, 8]
    rows.write_bytes(rows.read_bytes()[:30])  # a damaged cache entry is detected and rebuilt
    torch.testing.assert_close(shadow_rows("fp", "layer.0", w, torch.tensor([2, 7])).rows(torch.tensor([4])), w.t()[[4]])
    assert rows.stat().st_size == 7 * 6 * 4
    # another hot set is another file: the first one stays valid
    assert shadow_rows("fp", "layer.0", w, torch.tensor([2])).cold.numel() == 8
    assert rows.stat().st_size == 7 * 6 * 4


def test_rows_file_of_another_model_is_never_read(tmp_path, monkeypatch, caplog):
    """A rows file carries the key it was built for: another model's file of the same shape, copied
    under this model's name, is rebuilt (a shape check alone would have served the foreign rows)."""
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    w, other, hot = torch.randn(6, 9), torch.randn(6, 9), torch.tensor([0])
    shadow_rows("fp-a", "layer.0", w, hot)
    shadow_rows("fp-b", "layer.0", other, hot)
    (mine, mine_desc), (foreign, foreign_desc) = rows_files("fp-a", "layer.0", hot), rows_files("fp-b", "layer.0", hot)
    mine.write_bytes(foreign.read_bytes())
    mine_desc.write_bytes(foreign_desc.read_bytes())
    torch.testing.assert_close(shadow_rows("fp-a", "layer.0", w, hot).rows(torch.tensor([5])), w.t()[[5]])
    assert "was built for fp-b" in caplog.text
    # a description that names this model over another weight's rows: caught by the rows read back
    mine.write_bytes(foreign.read_bytes())
    store = shadow_rows("fp-a", "layer.0", w, hot)
    assert "does not hold this linear's weights" in caplog.text
    torch.testing.assert_close(store.rows(torch.tensor([0, 1, 4, 8])), w.t()[[0, 1, 4, 8]])


def test_a_store_product_is_the_residue_times_w_and_counts_hot_and_cold(tmp_path, monkeypatch):
    monkeypatch.setenv("LLMNPU_CACHE_DIR", str(tmp_path))
    w = torch.randn(5, 12)
    store = shadow_rows("fp", "l", w, torch.tensor([3, 4]))
    x = torch.randn(7, 12).clamp(-1, 1)
    x[0, 3], x[2, 3], x[5, 9] = 4.0, -6.0, 3.0          # two hot hits on one channel, one cold
    y, outliers = store.product(x, 1.5)
    torch.testing.assert_close(y, (x - x.clamp(-1.5, 1.5)) @ w.t(), rtol=1e-5, atol=1e-5)
    assert outliers == 3 and (store.hot_hits, store.cold_fetches) == (1, 1)
    assert store.product(x.clamp(-1, 1), 1.5) == (None, 0)


def test_a_prompt_leaves_no_channel_list_behind(shared_tiny_engine, monkeypatch):
    """The stores count the channels they read in batches; a runner settles them after each prompt,
    so no list outlives it (kept across prompts, they fragmented the heap: +50 MB and 10-28k page
    faults a prompt on the embedded model), and the prompt's reads are counted."""
    from llmnpu_delegate.format.rows import RowStore

    kept, count = [], RowStore.count
    monkeypatch.setattr(RowStore, "count", lambda self, ch: (kept.append(weakref.ref(ch)), count(self, ch))[1])
    stores = shared_tiny_engine.row_stores()
    before = sum(s.hot_hits + s.cold_fetches for s in stores)
    shared_tiny_engine(torch.randint(0, 1000, (3 * TINY_CHUNK,), generator=torch.Generator().manual_seed(5)))
    gc.collect()
    assert len(kept) >= len(stores) and all(r() is None for r in kept)
    assert sum(s.hot_hits + s.cold_fetches for s in stores) > before


# --------------------------------------------------------------------------- calibration
def _tiny(shape="tiny-llama", outliers=True):
    return outlier_model(f"random:{shape}") if outliers else load_model(f"random:{shape}")


def test_calibration_statistics_match_an_independent_reference():
    lm = _tiny()
    cfg = CalibConfig(samples=3, tokens=40, percentiles=(99.0, 99.9))
    ids = torch.randint(0, 1000, (400,))
    calib = calibrate(lm.model, ids, lm.fingerprint, cfg, progress=False)
    # reference: capture every linear input and compute with numpy
    seen = {n: [] for n in quantizable_linears(lm.model)}
    hooks = [m.register_forward_pre_hook(lambda _m, a, n=n: seen[n].append(a[0].reshape(-1, a[0].shape[-1]).clone()))
             for n, m in quantizable_linears(lm.model).items()]
    from llmnpu_delegate.quantize.calibrate import calibration_samples
    with torch.no_grad():
        for row in calibration_samples(ids, cfg):
            lm.model.model(input_ids=row[None])
    for h in hooks:
        h.remove()
    assert set(calib.layers) == set(seen)
    for name, xs in seen.items():
        a = torch.cat(xs).abs()
        st = calib.layers[name]
        assert st.absmax == pytest.approx(float(a.max()), rel=1e-6)
        torch.testing.assert_close(st.channel_absmax, a.amax(0))
        flat = np.sort(a.flatten().numpy())[::-1]
        for p in cfg.percentiles:
            thr = st.percentiles[p]
            above = int((a > thr).sum())
            assert above <= a.numel() * (1 - p / 100) + 1           # at most the tail share is above
            assert thr == pytest.approx(float(flat[int(a.numel() * (1 - p / 100))]), rel=1e-6)
            assert torch.equal(st.channel_outliers[p], (a > thr).sum(0))
        assert st.elements == a.numel()


def test_one_pass_statistics_are_exact_with_ties_at_every_threshold():
    """Small integers tie at every percentile, and the kept values cross batches: thresholds and
    per-channel counts beyond them equal those of all values at once."""
    from llmnpu_delegate.quantize.calibrate import _Recorder

    lin = torch.nn.Linear(16, 4)
    cfg = CalibConfig(samples=1, tokens=90, percentiles=(90.0, 97.0, 99.0))
    batches = [torch.randint(-6, 7, (30, 16)).float() * (1 + (torch.arange(16) == 5) * 3) for _ in range(3)]
    rec = _Recorder({"l": lin}, 90, cfg)
    hook = rec.hook("l")
    for x in batches:
        hook(lin, (x,))
    st, a = rec.stats()["l"], torch.cat(batches).abs()
    flat = a.flatten().sort(descending=True).values
    for p in cfg.percentiles:
        t = float(flat[int(a.numel() * (1 - p / 100))])
        assert st.percentiles[p] == t
        assert torch.equal(st.channel_outliers[p], (a > t).sum(0))
    assert st.elements == a.numel() and torch.equal(st.channel_absmax, a.amax(0))


def test_calibration_artefact_roundtrip_and_rejections(tmp_path):
    lm = _tiny()
    ids = torch.randint(0, 1000, (300,))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=2, tokens=32), progress=False)
    path = calib.save(tmp_path / "c.pt")
    again = Calibration.load(path)
    assert again.config == calib.config and again.text_sha == calib.text_sha
    for n in calib.layers:
        assert again.layers[n].percentiles == calib.layers[n].percentiles
    with pytest.raises(LlmNpuError, match="another model"):
        again.check_model("0000")
    d = load_checked(path, "calibration")
    d["version"] = 0
    save_checked(d, tmp_path / "old.pt", "calibration")
    with pytest.raises(LlmNpuError, match="format version 0"):
        Calibration.load(tmp_path / "old.pt")
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    with pytest.raises(LlmNpuError, match="corrupt"):
        Calibration.load(tmp_path / "bad.pt")
    with pytest.raises(LlmNpuError, match="not found"):
        Calibration.load(tmp_path / "missing.pt")
    other = load_model("random:tiny-qwen2")
    with pytest.raises(LlmNpuError, match="another model"):
        quantize_(other.model, again, QuantConfig(pruning_rate=0.0), other.fingerprint, progress=False)


def test_probe_is_taken_from_the_first_calibration_samples():
    lm = _tiny(outliers=False)
    ids = torch.randint(0, 1000, (500,))
    from llmnpu_delegate.quantize.calibrate import calibration_samples
    for probe_tokens, shape in ((20, (1, 20)), (64, (1, 64)), (100, (2, 64)), (10_000, (3, 64))):
        cfg = CalibConfig(samples=3, tokens=64, probe_tokens=probe_tokens)
        calib = calibrate(lm.model, ids, lm.fingerprint, cfg, progress=False)
        assert tuple(calib.probe_ids.shape) == shape
        assert torch.equal(calib.probe_ids, calibration_samples(ids, cfg)[: shape[0], : shape[1]])


def test_calibration_text_too_short():
    lm = _tiny(outliers=False)
    with pytest.raises(LlmNpuError, match="calibration text has 50 tokens"):
        calibrate(lm.model, torch.arange(50), lm.fingerprint, CalibConfig(samples=2, tokens=32), progress=False)


def test_configs_validate_and_roundtrip():
    for cfg in (QuantConfig(), QuantConfig(outliers="smooth", weights="tensor"), CalibConfig(samples=3)):
        assert type(cfg).from_dict(cfg.to_dict()) == cfg
    with pytest.raises(LlmNpuError):
        QuantConfig(pruning_rate=1.5)
    with pytest.raises(LlmNpuError):
        QuantConfig(outliers="magic")
    with pytest.raises(LlmNpuError):
        CalibConfig(percentiles=(100.0,))


def test_layers_to_prune_takes_least_important():
    imp = {"a": 0.5, "b": 0.01, "c": 2.0, "d": 0.02}
    assert layers_to_prune(imp, 0.5) == {"b", "d"}
    assert layers_to_prune(imp, 0.0) == set()
    assert layers_to_prune(imp, 1.0) == set(imp)


# --------------------------------------------------------------------------- quantize_ per family
def _rel_err(a, b):
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("shape", TINY)
def test_quantize_every_family_close_to_float(shape):
    lm = _tiny(shape)
    ids = torch.randint(0, 2000, (600,))
    # 2 of 64 channels carry outliers (3 %): clip at the 95th percentile, above the normal values
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=4, tokens=64, percentiles=(95.0, 99.5)),
                      progress=False)
    x = torch.randint(0, 2000, (1, 48))
    with torch.no_grad():
        ref = lm.model(input_ids=x).logits
        errs = {}
        for mode in ("none", "shadow"):
            import copy
            m = copy.deepcopy(lm.model)
            cfg = QuantConfig(outliers=mode, pruning_rate=0.0, clip_percentile=95.0)
            rep = quantize_(m, calib, cfg, lm.fingerprint, progress=False)
            assert rep.layers == len(quantizable_linears(lm.model)) > 0
            assert not any(isinstance(mod, torch.nn.Linear) and "layers" in n for n, mod in m.named_modules())
            errs[mode] = _rel_err(m(input_ids=x).logits, ref)
            if mode == "shadow":
                c = outlier_counters(m)
                assert 0 < c["outlier_elements"] < 0.10 * c["seen_elements"]
    assert errs["shadow"] < 0.05, errs
    assert errs["shadow"] < errs["none"], errs  # the outliers injected are what shadow execution fixes


def test_pruning_by_output_effect_is_profiled_once_and_saved(tmp_path):
    import copy
    lm = _tiny()
    ids = torch.randint(0, 2000, (400,))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=2, tokens=64, probe_tokens=32), progress=False)
    calib.save(tmp_path / "c.pt")
    cfg = QuantConfig(pruning_rate=0.5)
    m = copy.deepcopy(lm.model)
    rep = quantize_(m, calib, cfg, lm.fingerprint, progress=False)
    n = len(quantizable_linears(lm.model))
    assert len(rep.pruned_layers) == round(0.5 * n) and len(rep.shadow_layers) == n - round(0.5 * n)
    for name in rep.pruned_layers:
        q = m.get_submodule(name)
        assert q.pruned and q.shadow is None and q.full_scale == pytest.approx(calib.layers[name].absmax / 127)
    saved = Calibration.load(tmp_path / "c.pt")
    key = importance_key(cfg)
    assert len(saved.importance[key]) == n
    # the kept layers are the ones whose removal hurt most
    imp = saved.importance[key]
    assert min(imp[s] for s in rep.shadow_layers) >= max(imp[p] for p in rep.pruned_layers)


@pytest.mark.parametrize("shape", TINY)
def test_output_importance_replay_equals_full_recompute(shape):
    """Replaying the unchanged early blocks gives the same effects as running everything: a layer with
    real outliers measured alone, the quiet layers of a block together, sharing their effect."""
    import copy

    from llmnpu_delegate.quantize import importance as I
    lm = _tiny(shape)
    ids = torch.randint(0, 2000, (400,))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=2, tokens=48, probe_tokens=96,
                                                                 percentiles=(95.0, 99.5)), progress=False)
    float_logits = I.logits_of(lm.model, calib.probe_ids)
    m = copy.deepcopy(lm.model)
    quantize_(m, calib, QuantConfig(pruning_rate=0.0, clip_percentile=95.0), lm.fingerprint, progress=False)
    layers = {n: m.get_submodule(n) for n in quantizable_linears(lm.model)}
    calls = []
    hooks = [blk.register_forward_hook(lambda *_a, i=i: calls.append(i)) for i, blk in enumerate(m.model.layers)]
    fast = I.output_importance(m, layers, calib.probe_ids, float_logits, calib, 95.0, progress=False)
    for h in hooks:
        h.remove()
    n_blocks = len(m.model.layers)
    block_of = {n: int(n.split(".layers.")[1].split(".")[0]) for n in layers}
    groups = I.profile_groups(calib, list(layers), 95.0, block_of)
    assert any(len(g) == 1 for g in groups) and any(len(g) > 1 for g in groups)      # both kinds occur
    assert sorted(n for g in groups for n in g) == sorted(layers)
    assert len(calls) == n_blocks + sum(n_blocks - block_of[g[0]] for g in groups)  # early blocks were replayed
    ref = I._kl(float_logits.log_softmax(-1), I.logits_of(m, calib.probe_ids))
    for group in groups:
        for name in group:
            layers[name].pruned = True
        slow = I._kl(float_logits.log_softmax(-1), I.logits_of(m, calib.probe_ids)) - ref
        for name in group:
            layers[name].pruned = False
            assert fast[name] == pytest.approx(slow / len(group), rel=1e-4, abs=1e-7), name
    assert any(v > 0 for v in fast.values())
    assert all(type(b).__name__ != "_Replay" for b in m.model.layers)  # the stack is restored


def test_quantize_modes_build_what_they_claim():
    """smooth: x/s and W*s with the absmax of the smoothed input; tensor weights: one scale per layer;
    shadow: the hot rows are the calibration's hot channels."""
    import copy

    from llmnpu_delegate.quantize.apply import _smooth_factors
    lm = _tiny()
    ids = torch.randint(0, 2000, (400,))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=2, tokens=64), progress=False)
    linears = quantizable_linears(lm.model)
    for cfg in (QuantConfig(outliers="smooth"), QuantConfig(outliers="shadow", weights="tensor", pruning_rate=0.0)):
        m = copy.deepcopy(lm.model)
        quantize_(m, calib, cfg, lm.fingerprint, progress=False)
        for name, lin in linears.items():
            q, st = m.get_submodule(name), calib.layers[name]
            x = torch.randn(10, lin.in_features) * 3
            x[:, 3] *= 30
            if cfg.outliers == "smooth":
                s = _smooth_factors(st.channel_absmax, lin.weight, 0.5)
                torch.testing.assert_close(q.smooth, s)
                assert q.full_scale == pytest.approx(float((st.channel_absmax / s).max()) / 127, rel=1e-6)
                w_q, w_s = quantize_weight(lin.weight * s[None, :], "channel")
                ref = fake_quant(x / s, q.full_scale) @ (w_q.float() * w_s[:, None]).t()
                with torch.no_grad():
                    torch.testing.assert_close(q(x), ref + (0 if lin.bias is None else lin.bias), rtol=1e-4, atol=1e-4)
            else:
                assert torch.all(q.weight_scale == q.weight_scale[0])
                from llmnpu_delegate.quantize.shadow_rows import hot_channels
                assert torch.equal(q.shadow.hot, hot_channels(st.channel_outliers[99.5], 0.8))
