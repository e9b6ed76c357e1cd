"""Sweeps as Ray tasks (``fanout.py``, ``--ray`` / ``--ray-address``): on a Ray cluster of two nodes
on loopback, started here and torn down after, each sweep gives the sequential run's results, runs
on both nodes, and reports a failed job with its cause while the others finish."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from conftest import missing

from llmnpu_delegate.cli import main
from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.fanout import LOCAL, Failure, Job, check_ray, run_jobs

HAVE_RAY = importlib.util.find_spec("ray") is not None
needs_ray = pytest.mark.skipif(not HAVE_RAY, reason=missing("the ray extra (pip install -e '.[ray]')"))
NODE_CPUS = 2       # each node's CPUs: a job that takes the test's 2 threads fills one node


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ray(*args: str, env: dict) -> subprocess.Popen:
    """``ray ...`` in a process group of its own: the node's daemons stay in it, so killing the group
    ends this cluster only (``ray stop`` would end every Ray process of the machine)."""
    exe = Path(sys.executable).with_name("ray")
    return subprocess.Popen([str(exe), *args], env=env, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def cluster():
    """A head and a second worker node on 127.0.0.1 (token authentication off: loopback only); yields
    the head's address."""
    if not HAVE_RAY:
        pytest.skip(missing("the ray extra (pip install -e '.[ray]')"))
    port = _free_port()
    address = f"127.0.0.1:{port}"
    temp = tempfile.mkdtemp(prefix="ray-")     # short: Ray's socket paths live under it
    saved = os.environ.get("RAY_AUTH_MODE")
    os.environ["RAY_AUTH_MODE"] = "disabled"
    env = {**os.environ}
    common = ["--node-ip-address=127.0.0.1", f"--num-cpus={NODE_CPUS}", "--object-store-memory=300000000",
              "--disable-usage-stats"]
    nodes = [_ray("start", "--head", f"--port={port}", "--include-dashboard=false", f"--temp-dir={temp}", *common,
                  env=env)]
    try:
        if nodes[0].wait(timeout=120) != 0:
            pytest.fail(f"ray start --head failed: {nodes[0].stderr.read()[-2000:]}")
        nodes.append(_ray("start", f"--address={address}", *common, env=env))
        if nodes[1].wait(timeout=120) != 0:
            pytest.fail(f"ray start (worker) failed: {nodes[1].stderr.read()[-2000:]}")
        _wait_for_nodes(address, 2, env)
        yield address
    finally:
        for node in nodes:
            try:
                os.killpg(node.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        shutil.rmtree(temp, ignore_errors=True)
        if saved is None:
            os.environ.pop("RAY_AUTH_MODE", None)
        else:
            os.environ["RAY_AUTH_MODE"] = saved


def _wait_for_nodes(address: str, count: int, env: dict, timeout: float = 90) -> None:
    exe = Path(sys.executable).with_name("ray")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        out = subprocess.run([str(exe), "status", f"--address={address}"], env=env, capture_output=True,
                             text=True, timeout=60).stdout
        active = out.split("Active:")[-1].split("Pending:")[0] if "Active:" in out else ""
        if len(re.findall(r"\bnode_[0-9a-f]+", active)) >= count:
            return
        time.sleep(1)
    pytest.fail(f"the Ray cluster at {address} did not reach {count} nodes in {timeout:.0f} s")


def _words(n: int, step: int = 1) -> str:
    base = "the quick brown fox jumps over the lazy dog while a river runs past old stone houses".split()
    return " ".join(base[(i * step) % len(base)] for i in range(n))


# ------------------------------------------------------------------ without a cluster
def test_a_head_that_does_not_answer_is_one_line_before_the_model_loads(capsys):
    started = time.monotonic()
    assert main(["eval", "--model", "random:tiny-llama", "--ray-address", f"127.0.0.1:{_free_port()}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no Ray cluster answers at 127.0.0.1:" in err and "ray start --head" in err
    assert time.monotonic() - started < 30      # Ray alone retries such an address for minutes
    assert main(["eval", "--ray-address", "nohost"]) == 2
    assert "host:port" in capsys.readouterr().err


def test_without_ray_installed_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)      # import ray -> ImportError
    with pytest.raises(LlmNpuError, match=r"not installed: pip install 'llmnpu_delegate\[ray\]'"):
        check_ray(LOCAL)


def test_export_fans_out_over_socs_only(tmp_path, capsys):
    out = str(tmp_path / "m.pte")
    assert main(["export", "--soc", "SM8650,SM8650", "--out", out]) == 2
    assert "each once" in capsys.readouterr().err
    assert main(["export", "--soc", "SM8650,SM9999", "--out", out]) == 2
    assert "SM9999" in capsys.readouterr().err
    if HAVE_RAY:
        assert main(["export", "--backend", "cpu-int8", "--ray", "--out", out]) == 2
        assert "no SoC to fan out over" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_sequential_jobs_keep_their_order_and_names():
    ran = run_jobs([Job("b", int, ("7",)), Job("a", int, ("3",))])
    assert list(ran.results) == ["b", "a"] and ran.results == {"b": 7, "a": 3} and ran.nodes == {}
    with pytest.raises(LlmNpuError, match="share a name"):
        run_jobs([Job("a", int, ("1",)), Job("a", int, ("2",))])


# ------------------------------------------------------------------ on the cluster
@needs_ray
def test_eval_on_two_nodes_gives_the_sequential_numbers(cluster, tmp_path, capsys):
    """Perplexity of three modes (one with the automatic pruning, priced on this machine and carried to
    the workers in the calibration): the same numbers to the last bit, computed on both nodes."""
    (tmp_path / "e.txt").write_text(_words(600))
    (tmp_path / "c.txt").write_text(_words(900, 7))
    cmd = ["eval", "--model", "random:tiny-llama", "--text-file", str(tmp_path / "e.txt"),
           "--calib-text-file", str(tmp_path / "c.txt"), "--max-tokens", "120", "--window", "32",
           "--calib-samples", "2", "--calib-tokens", "64", "--threads", str(NODE_CPUS), "--no-progress",
           "--modes", "fp32", "w8a8", "w8a8-shadow-pruned"]
    assert main(cmd + ["--json"]) == 0
    sequential = json.loads(capsys.readouterr().out)
    assert main(cmd + ["--json", "--ray-address", cluster]) == 0
    on_ray = json.loads(capsys.readouterr().out)
    assert on_ray["results"] == sequential["results"]
    assert 0.0 <= on_ray["results"]["w8a8-shadow-pruned"]["pruning_rate"] <= 1.0
    ray = on_ray["ray"]
    assert ray["address"] == cluster and set(ray["nodes"]) == {"fp32", "w8a8", "w8a8-shadow-pruned"}
    assert len(set(ray["nodes"].values())) == 2, ray["nodes"]     # each job fills a node: both took some
    assert main(cmd + ["--ray-address", cluster]) == 0
    assert "3 modes as Ray tasks on the Ray cluster at" in capsys.readouterr().out


@needs_ray
def test_lm_eval_rows_on_two_nodes_give_the_sequential_scores(cluster, tmp_path, capsys):
    """`eval --tasks` with a mode per Ray task: lm-eval's scores and bootstrapped standard errors
    (cloze perplexity is bootstrapped: lm-eval's process pool hung in a Ray worker) as in one process."""
    if importlib.util.find_spec("lm_eval") is None:
        pytest.skip(missing("the eval extra (lm-eval)"))
    (tmp_path / "c.txt").write_text(_words(900, 7))
    cmd = ["eval", "--model", "random:tiny-llama", "--tasks", "llmnpu_cloze", "--limit", "4", "--modes", "fp32",
           "w8a8", "--calib-text-file", str(tmp_path / "c.txt"), "--calib-samples", "2", "--calib-tokens", "64",
           "--threads", str(NODE_CPUS), "--no-progress", "--json"]
    assert main(cmd) == 0
    sequential = json.loads(capsys.readouterr().out)
    assert main(cmd + ["--ray-address", cluster]) == 0
    on_ray = json.loads(capsys.readouterr().out)
    assert on_ray["results"] == sequential["results"] and on_ray["samples"] == sequential["samples"]
    assert isinstance(on_ray["results"]["w8a8"]["llmnpu_cloze"]["perplexity"][1], float)   # a bootstrapped stderr
    assert len(set(on_ray["ray"]["nodes"].values())) == 2


@needs_ray
def test_a_failed_job_is_reported_and_the_others_finish(cluster):
    """A node whose model differs from the caller's (its fingerprint does not match) and a job no node
    can hold: each a Failure with its cause; the job beside them returns the sequential number."""
    from llmnpu_delegate.evaluate import perplexity, score
    from llmnpu_delegate.models import load_model

    lm = load_model("random:tiny-llama")
    windows = torch.randint(0, 200, (2, 16), generator=torch.Generator().manual_seed(1))
    args = (windows, None, None, "fp32", None, None, False)
    ran = run_jobs([Job("good", score, ((lm.spec, lm.fingerprint), *args), NODE_CPUS),
                    Job("other weights", score, ((lm.spec, "0" * 16), *args), NODE_CPUS),
                    Job("too big", score, ((lm.spec, lm.fingerprint), *args), 64)], cluster)
    assert ran.results["good"] == {"ppl": perplexity(lm.model, windows, progress=False)}
    bad = ran.results["other weights"]
    assert isinstance(bad, Failure) and bad.cause.startswith("LlmNpuError: ") and "other weights" in bad.cause
    big = ran.results["too big"]
    assert isinstance(big, Failure) and "no node of the Ray cluster has 64 CPUs" in big.cause
    assert set(ran.nodes) == {"good"}


def _masked(pte: bytes) -> bytes:
    """The program without the creation time each HTP context binary stamps after its magic number
    (two sequential exports of one SoC differ there only)."""
    return re.sub(rb"\xcd\xab\x78\x56.{8}", b"\xcd\xab\x78\x56" + bytes(8), pte, flags=re.DOTALL)


def _sidecar(path: Path) -> dict:
    """A sidecar without what names its own files (and hashes the stamped program)."""
    meta = json.loads(path.read_text())
    for key in ("pte", "pte_sha256", "sidecar_sha256"):
        meta.pop(key)
    meta["tokenizer"].pop("folder")
    meta["shadow"].pop("rows_file", None)
    return meta


@needs_ray
@pytest.mark.slow
def test_export_for_two_socs_on_ray_writes_the_sequential_programs(cluster, tmp_path, capsys):
    """`export --soc SM8650,SM8750` on the cluster: a program per SoC, each the one a sequential export
    for that SoC writes (its sidecar and its bytes, but for the context binaries' creation times)."""
    if importlib.util.find_spec("onnxruntime_qnn") is None:
        pytest.skip(missing("the qnn extra (onnxruntime-qnn)"))
    cmd = ["export", "--model", "random:tiny-llama", "--backend", "qnn", "--chunk", "32", "--blocks", "1",
           "--context", "128", "--decode", "fp32", "--placement", "paper", "--workers", str(NODE_CPUS), "--no-progress"]
    assert main(cmd + ["--soc", "SM8650,SM8750", "--out", str(tmp_path / "m.pte"), "--ray-address", cluster,
                       "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result["programs"]) == {"SM8650", "SM8750"} and len(set(result["ray"]["nodes"].values())) == 2
    for soc in ("SM8650", "SM8750"):
        assert result["programs"][soc]["soc"] == soc
        assert json.loads((tmp_path / f"m-{soc}.json").read_text())["soc"] == soc
    assert main(cmd + ["--soc", "SM8750", "--out", str(tmp_path / "seq.pte")]) == 0
    capsys.readouterr()
    ours, theirs = (tmp_path / "m-SM8750.pte").read_bytes(), (tmp_path / "seq.pte").read_bytes()
    assert len(ours) == len(theirs) and _masked(ours) == _masked(theirs)
    assert _sidecar(tmp_path / "m-SM8750.json") == _sidecar(tmp_path / "seq.json")
    assert _masked((tmp_path / "m-SM8650.pte").read_bytes()) != _masked(theirs)     # a program per SoC
