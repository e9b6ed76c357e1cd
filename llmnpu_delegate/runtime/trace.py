"""What ran where and when: metrics of one prefill run, a Chrome/Perfetto trace and a timeline picture."""
from __future__ import annotations

import json
from pathlib import Path

from ..paths import atomic_path
from .schedule import PROCESSORS, Record, RunStats


def metrics(stats: RunStats) -> dict:
    """Wall time, busy time per processor, the NPU's bubble rate (idle share between its first
    start and last end) and the two-engine bound max(sum of NPU task times, sum of CPU task times)."""
    out = {"wall_s": stats.wall_s}
    for p in PROCESSORS:
        recs = [r for r in stats.records if r.processor == p]
        busy = sum(r.end - r.start for r in recs)
        out[f"{p}_busy_s"] = busy
        span = (max(r.end for r in recs) - min(r.start for r in recs)) if recs else 0.0
        out[f"{p}_bubble_rate"] = 1 - busy / span if span > 0 else 0.0
    out["bound_s"] = max(out["npu_busy_s"], out["cpu_busy_s"])
    out["decision_us"] = 1e6 * stats.decision_s / max(stats.decisions, 1)
    return out


def step_label(sub) -> str:
    """How a subgraph is named in traces: kind, layer, index."""
    where = f"L{sub.layer}" if sub.layer is not None else "model"
    return f"{sub.kind} {where} #{sub.index}"


def chrome_trace(stats: RunStats, names: dict[int, str] | None = None) -> dict:
    """Trace Event Format: one complete event per task, one thread row per processor."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "args": {"name": "llmnpu prefill"}}]
    for tid, p in enumerate(PROCESSORS):
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": tid, "args": {"name": p}})
    for r in stats.records:
        label = (names or {}).get(r.step, f"subgraph {r.step}")
        events.append({"name": f"c{r.chunk} {label}", "ph": "X", "pid": 0, "tid": PROCESSORS.index(r.processor),
                       "ts": r.start * 1e6, "dur": (r.end - r.start) * 1e6,
                       "args": {"chunk": r.chunk, "subgraph": r.step}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def read_trace(path: Path) -> RunStats:
    """A trace written by ``write_trace`` or by the native runner (``--trace``) back as ``RunStats``."""
    events = json.loads(Path(path).read_text())["traceEvents"]
    stats = RunStats()
    for e in events:
        if e.get("ph") == "X":
            start = e["ts"] / 1e6
            stats.records.append(Record(len(stats.records), e["args"]["chunk"], e["args"]["subgraph"],
                                        PROCESSORS[e["tid"]], start, start + e["dur"] / 1e6))
    stats.wall_s = max((r.end for r in stats.records), default=0.0)
    return stats


def write_trace(stats: RunStats, path: Path, names: dict[int, str] | None = None) -> Path:
    with atomic_path(Path(path)) as tmp:
        tmp.write_text(json.dumps(chrome_trace(stats, names)))
    return Path(path)


def write_timeline(stats: RunStats, path: Path, title: str = "") -> Path:
    """Two rows (npu, cpu), one bar per task coloured by chunk: the picture that shows bubbles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    chunks = max((r.chunk for r in stats.records), default=0) + 1
    cmap = plt.get_cmap("tab10" if chunks <= 10 else "viridis", max(chunks, 1))
    fig, ax = plt.subplots(figsize=(14, 2.6))
    for row, p in enumerate(PROCESSORS):
        recs = [r for r in stats.records if r.processor == p]
        ax.broken_barh([(1e3 * r.start, 1e3 * (r.end - r.start)) for r in recs], (row - 0.4, 0.8),
                       facecolors=[cmap(r.chunk % cmap.N) for r in recs], linewidth=0)
    ax.set_yticks(range(len(PROCESSORS)), PROCESSORS)
    ax.set_xlabel("ms")
    m = metrics(stats)
    ax.set_title(f"{title}  wall {1e3 * m['wall_s']:.0f} ms, NPU bubbles {100 * m['npu_bubble_rate']:.1f} %".strip())
    handles = [plt.Rectangle((0, 0), 1, 1, color=cmap(i % cmap.N)) for i in range(min(chunks, 10))]
    ax.legend(handles, [f"chunk {i}" for i in range(min(chunks, 10))], loc="upper right", fontsize=7,
              ncol=min(chunks, 10))
    fig.tight_layout()
    with atomic_path(Path(path)) as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
    return Path(path)
