"""Loaders against damaged artefacts, generated with hypothesis: a calibration artefact, a graph-cache
entry, a schedule profile, a .pte sidecar (Python and native runners). Each corruption gives a
one-line error naming the file and the fix, or, for a cache, a rebuild with a warning: never a
traceback, never a silently different result.

Two kinds of damage: bytes (truncated, a byte flipped: what disks and copies do; the checksums
catch every one) and structure (a key deleted or a value of the wrong type, with the checksum made
to fit: what a buggy or foreign writer does)."""
import copy
import json
import logging
import shutil
import time

import pytest
import torch
from conftest import outlier_model
from hypothesis import HealthCheck, given, settings, strategies as st

from llmnpu_delegate.backends.cpu_int8 import CpuInt8Engine
from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.paths import load_checked, save_checked
from llmnpu_delegate.quantize import CalibConfig, Calibration, QuantConfig, calibrate, load_or_calibrate, plan_linears
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.runtime.profile import Profile

FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
BYTES = st.one_of(st.tuples(st.just("truncate"), st.floats(0, 0.999)),
                  st.tuples(st.just("flip"), st.floats(0, 0.999), st.integers(1, 255)))
WRONG = st.sampled_from([None, "x", [1, 2], {"k": 1}, -1, 1.5, True, torch.zeros(2, dtype=torch.int16)])


def damage_bytes(data: bytes, how) -> bytes:
    at = int(how[1] * len(data))
    if how[0] == "truncate":
        return data[:at]
    return data[:at] + bytes([data[at] ^ how[2]]) + data[at + 1:]


def paths_in(obj, prefix=(), depth=4):
    """Every place in a nested dict/list (lists: their first element), down to ``depth``."""
    if prefix:
        yield prefix
    if depth == 0:
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths_in(v, prefix + (k,), depth - 1)
    elif isinstance(obj, list) and obj:
        yield from paths_in(obj[0], prefix + (0,), depth - 1)


def mutated(obj, path, value, delete: bool):
    out = copy.deepcopy(obj)
    parent = out
    for k in path[:-1]:
        parent = parent[k]
    if delete:
        del parent[path[-1]]
    else:
        parent[path[-1]] = value
    return out


def kind(v) -> str:
    return "number" if isinstance(v, (int, float)) and not isinstance(v, bool) else type(v).__name__


def at(obj, path):
    for k in path:
        obj = obj[k]
    return obj


@st.composite
def structure(draw, obj, json_only=False):
    """(path, value, delete?) over ``obj``: a key deleted, or a value replaced by one of another kind
    (a number stays a number only by luck of the writer: that is no damage a loader can see)."""
    path = draw(st.sampled_from(sorted(paths_in(obj), key=str)))
    original = at(obj, path)
    choices = WRONG.filter(lambda v: kind(v) != kind(original) and not (json_only and isinstance(v, torch.Tensor)))
    return path, draw(choices), draw(st.booleans())


def one_line_naming(error: Exception, path, fix: str) -> None:
    msg = str(error)
    assert "\n" not in msg and str(path.name) in msg and fix in msg, msg


# --------------------------------------------------------------------------- calibration artefact
@pytest.fixture(scope="module")
def tiny():
    lm = outlier_model()
    ids = torch.randint(0, 1000, (256,), generator=torch.Generator().manual_seed(1))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    return lm, ids, calib


def test_a_model_with_injected_outliers_is_filed_apart_from_the_clean_one(tiny):
    """The tests' outlier models key their calibrations and graphs by their own weights: under the
    clean model's key a CLI run of the same spec would read them (as it once did)."""
    from llmnpu_delegate.models import fingerprint, load_model

    lm = tiny[0]
    assert lm.fingerprint == fingerprint(lm.model)
    assert lm.fingerprint != load_model("random:tiny-llama").fingerprint


@pytest.fixture(scope="module")
def calib_file(tiny, tmp_path_factory):
    return tiny[2].save(tmp_path_factory.mktemp("calib") / "c.pt")


@FUZZ
@given(how=BYTES)
def test_damaged_calibration_artefact_is_a_one_line_error(calib_file, tmp_path, how):
    bad = tmp_path / "damaged.pt"
    bad.write_bytes(damage_bytes(calib_file.read_bytes(), how))
    with pytest.raises(LlmNpuError) as e:
        Calibration.load(bad)
    one_line_naming(e.value, bad, "recalibrate")


@FUZZ
@given(data=st.data())
def test_malformed_calibration_artefact_is_refused_or_works(tiny, calib_file, tmp_path, data):
    lm, _, calib = tiny
    payload = load_checked(calib_file, "calibration")
    path, value, delete = data.draw(structure(payload))
    bad = tmp_path / "malformed.pt"
    save_checked(mutated(payload, path, value, delete), bad, "calibration")
    try:
        loaded = Calibration.load(bad)
    except LlmNpuError as e:
        one_line_naming(e, bad, "recalibrate")
        return
    try:   # accepted: then it must plan the model like the original, or refuse with a clear error
        got = plan_linears(lm.model, loaded, QuantConfig(pruning_rate=0.5, importance="ratio"), lm.fingerprint,
                              progress=False)
    except LlmNpuError:
        return
    want = plan_linears(lm.model, calib, QuantConfig(pruning_rate=0.5, importance="ratio"), lm.fingerprint,
                              progress=False)
    assert {n: (p.act_scale, p.clip) for n, p in got.items()} == {n: (p.act_scale, p.clip) for n, p in want.items()}


def test_damaged_calibration_in_the_cache_is_recalibrated(tiny, tmp_path, caplog):
    lm, ids, _ = tiny
    config = CalibConfig(samples=4, tokens=64, probe_tokens=64)
    first = load_or_calibrate(lm.model, ids, lm.fingerprint, config, progress=False)
    first.path.write_bytes(damage_bytes(first.path.read_bytes(), ("flip", 0.5, 1)))
    with caplog.at_level(logging.WARNING):
        again = load_or_calibrate(lm.model, ids, lm.fingerprint, config, progress=False)
    assert "recalibrating" in caplog.text and "corrupt" in caplog.text
    assert Calibration.load(again.path).text_sha == first.text_sha
    mine = tmp_path / "mine.pt"                      # a file the user named is theirs: an error, not a rebuild
    mine.write_bytes(b"garbage")
    with pytest.raises(LlmNpuError, match="mine.pt is corrupt"):
        load_or_calibrate(lm.model, ids, lm.fingerprint, config, path=mine, progress=False)


def test_two_callers_at_once_calibrate_once(tiny, monkeypatch):
    """Two commands (or test workers) starting on one model at the same time: the second waits for the
    first's calibration and loads it, instead of calibrating again beside it."""
    import importlib
    import threading

    calibrate_module = importlib.import_module("llmnpu_delegate.quantize.calibrate")   # the package's name is the function's
    lm, ids, _ = tiny
    config = CalibConfig(samples=2, tokens=48, probe_tokens=48)     # an artefact no other test makes
    runs, real = [], calibrate_module.calibrate

    def slow_calibrate(*args, **kwargs):
        runs.append(threading.get_ident())
        time.sleep(0.5)          # both callers are inside load_or_calibrate meanwhile
        return real(*args, **kwargs)

    monkeypatch.setattr(calibrate_module, "calibrate", slow_calibrate)
    got = [None, None]

    def call(i):
        got[i] = load_or_calibrate(lm.model, ids, lm.fingerprint, config, progress=False)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(runs) == 1, "both callers calibrated"
    assert got[0].path == got[1].path and got[0].path.is_file()
    assert got[0].text_sha == got[1].text_sha


# --------------------------------------------------------------------------- graph-cache entries
@pytest.fixture(scope="module")
def engine(tiny, tmp_path_factory):
    lm, _, calib = tiny
    root = tmp_path_factory.mktemp("graphs")
    engine = Prefiller(lm, 16, quant=QuantConfig(pruning_rate=0.5), calibration=calib, cache=GraphCache(root),
                       progress=False)
    return engine, root


def _lower_all(engine, root):
    """Every NPU subgraph lowered through a fresh cache on ``root``; its outputs on a fixed input."""
    backend = CpuInt8Engine(engine.model, engine.fingerprint, engine.chunk_len, engine.plans, cache=GraphCache(root))
    outs = []
    for sub in engine.partition.by_kind("npu"):
        region = backend.lower_npu(sub)
        x = torch.randn(engine.chunk_len, region.in_features, generator=torch.Generator().manual_seed(sub.index))
        outs.append(region(x * 3))
    return backend.cache.stats, outs


@pytest.fixture(scope="module")
def region_outputs(engine):
    return _lower_all(*engine)[1]


@FUZZ
@given(how=BYTES)
def test_damaged_graph_cache_entries_are_rebuilt(engine, region_outputs, tmp_path, how, caplog):
    _, root = engine
    copy_root = tmp_path / "graphs"
    shutil.rmtree(copy_root, ignore_errors=True)
    copy_root.mkdir()
    entries = sorted(root.glob("*.pt"))
    for f in entries:
        (copy_root / f.name).write_bytes(damage_bytes(f.read_bytes(), how))
    with caplog.at_level(logging.WARNING):
        stats, outs = _lower_all(engine[0], copy_root)
    assert stats.rebuilt == len(entries) and "rebuilding it" in caplog.text
    assert all(torch.equal(a, b) for x, y in zip(outs, region_outputs) for a, b in zip(x, y))


@FUZZ
@given(data=st.data())
def test_malformed_graph_cache_entries_are_rebuilt_or_equal(engine, region_outputs, tmp_path, data):
    _, root = engine
    copy_root = tmp_path / "graphs"
    shutil.rmtree(copy_root, ignore_errors=True)
    copy_root.mkdir()
    entries = sorted(root.glob("*.pt"))
    sample = load_checked(entries[0], "graph-cache-entry")
    path, value, delete = data.draw(structure(sample["payload"]))
    for f in entries:
        entry = load_checked(f, "graph-cache-entry")
        try:
            entry["payload"] = mutated(entry["payload"], path, value, delete)
        except (KeyError, IndexError, TypeError):
            pass
        save_checked(entry, copy_root / f.name, "graph-cache-entry")
    _, outs = _lower_all(engine[0], copy_root)
    assert all(torch.equal(a, b) for x, y in zip(outs, region_outputs) for a, b in zip(x, y))


# --------------------------------------------------------------------------- schedule profile
@FUZZ
@given(how=BYTES, data=st.data())
def test_damaged_or_foreign_profile_is_profiled_again(engine, tmp_path, how, data):
    prefiller = engine[0]
    good = prefiller._profile_path()
    bad = tmp_path / "profile.json"
    if data.draw(st.booleans()):
        bad.write_bytes(damage_bytes(good.read_bytes(), how))
    else:
        d = json.loads(good.read_text())
        path, value, delete = data.draw(structure(d, json_only=True))
        bad.write_text(json.dumps(mutated(d, path, value, delete)))
    loaded = Profile.load(bad, prefiller.program)       # never raises
    if loaded is not None:
        assert set(loaded.static) | set(loaded.dynamic) == set(range(len(prefiller.program.steps)))
        assert all(v >= 0 for v in loaded.static.values())
