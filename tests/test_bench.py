"""Traces, metrics and the bench command (structure only: speed is measured by the benchmark, not tests)."""
import json

import pytest

from llmnpu_delegate.runtime.schedule import Record, RunStats
from llmnpu_delegate.runtime.trace import (
    chrome_trace,
    metrics,
    write_timeline,
    write_trace,
)


def _stats():
    s = RunStats()
    # npu: busy 0-1, 3-4 (idle 1-3: 2 of a 4 s span); cpu: 1-3
    s.records = [Record(0, 0, 0, "npu", 0.0, 1.0), Record(1, 0, 1, "cpu", 1.0, 3.0), Record(2, 1, 0, "npu", 3.0, 4.0)]
    s.wall_s, s.decisions, s.decision_s = 4.0, 3, 3e-6
    return s


def test_metrics():
    m = metrics(_stats())
    assert m["npu_busy_s"] == 2.0 and m["cpu_busy_s"] == 2.0
    assert m["npu_bubble_rate"] == pytest.approx(0.5)
    assert m["bound_s"] == 2.0 and m["decision_us"] == pytest.approx(1.0)


def test_chrome_trace_and_timeline(tmp_path):
    trace = chrome_trace(_stats(), {0: "npu L0", 1: "cpu L0"})
    tasks = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(tasks) == 3 and tasks[1]["tid"] == 1 and tasks[1]["dur"] == pytest.approx(2e6)
    path = write_trace(_stats(), tmp_path / "t.json")
    assert json.loads(path.read_text())["traceEvents"]
    png = write_timeline(_stats(), tmp_path / "t.png", "test")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_command(tmp_path, capsys):
    from llmnpu_delegate.cli import main

    assert main(["bench", "--model", "random:tiny-llama", "--prompt-len", "40", "--chunk", "16", "--repeats", "1",
                 "--quant", "fp32", "--trace-dir", str(tmp_path), "--json", "--no-progress"]) == 0
    r = json.loads(capsys.readouterr().out)
    for key in ("model", "prompt_len", "chunk", "threads", "hf_fp32_tok_s", "inorder_tok_s", "overlap_tok_s",
                "ooo_tok_s", "bound_tok_s", "bubble_rate_inorder", "bubble_rate_ooo", "speedup_vs_hf",
                "ooo_vs_inorder", "efficiency_vs_bound", "llamacpp_tok_s"):
        assert key in r, key
    assert r["llamacpp_tok_s"] is None and "GGUF" in r["llamacpp_reason"]
    assert all(r[f"{p}_tok_s"] > 0 for p in ("inorder", "overlap", "ooo"))
    assert (tmp_path / "ooo.png").is_file() and (tmp_path / "inorder.trace.json").is_file()
    assert main(["bench", "--model", "random:tiny-llama", "--prompt-len", "0", "--quant", "fp32"]) == 2
    assert main(["bench", "--model", "random:tiny-llama", "--repeats", "0", "--quant", "fp32"]) == 2
