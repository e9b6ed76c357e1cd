"""Offline profile of each subgraph's time on its processor, for the out-of-order policy.

Static subgraphs cost the same at every chunk position (median over positions); a dynamic one
(attention) grows with the keys it reads, so its cost is kept per position and extrapolated in
proportion to the key count beyond the profiled positions. Stored as JSON next to the graph cache.
"""
from __future__ import annotations

import json
import logging
import math
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..paths import atomic_path
from .program import ChunkProgram

VERSION = 1
log = logging.getLogger(__name__)


@dataclass
class Profile:
    static: dict[int, float]            # step -> seconds
    dynamic: dict[int, list[float]]     # step -> seconds at chunk positions 0, 1, ...

    @classmethod
    def from_records(cls, records, program: ChunkProgram, chunk_len: int) -> "Profile":
        """From the records of one run or several (a task's time is then its median over the runs).

        NPU subgraphs of equal structure (the same region of every layer) get one cost, the median
        of theirs: they do the same work, and ``ooo`` runs the cheapest ready NPU task first, so
        measurement noise between them would decide the order. It did: one layer's gate/up measured
        a little cheaper kept winning over the same gate/up of the chunks behind, which fell layers
        behind and left the NPU idle at the end (efficiency 0.91 instead of 0.95 in such runs)."""
        runs: dict[int, dict[int, list[float]]] = {}
        for r in records:
            runs.setdefault(r.step, {}).setdefault(r.chunk, []).append(r.end - r.start)
        static, dynamic = {}, {}
        for step, per_chunk in runs.items():
            times = {chunk: statistics.median(ts) for chunk, ts in per_chunk.items()}
            if program.steps[step].static:
                static[step] = statistics.median(times.values())
            else:
                dynamic[step] = [times[p] for p in sorted(times)]
        alike: dict[tuple, list[int]] = {}
        for step in static:
            sub = program.steps[step].sub
            if sub.kind == "npu" and sub.nodes:      # a program read back from a .pte has no graph: kept apart
                alike.setdefault(sub.structure(), []).append(step)
        for steps in alike.values():
            cost = statistics.median(static[s] for s in steps)
            static.update(dict.fromkeys(steps, cost))
        return cls(static, dynamic)

    def cost(self, step: int, position: float) -> float:
        """Seconds of ``step`` at chunk ``position``; a fractional position (a prompt that continues
        a past of part of a chunk) reads keys between two profiled positions'."""
        if step in self.static:
            return self.static[step]
        times = self.dynamic.get(step)
        if not times:
            return 0.0
        if position <= len(times) - 1:
            low = int(position)
            high = min(low + 1, len(times) - 1)
            return times[low] + (times[high] - times[low]) * (position - low)
        return times[-1] * (position + 1) / len(times)   # attention reads (position + 1) chunks of keys

    def costs(self, chunks: int, past_chunks: float = 0.0, last_rows: float = 1.0) -> dict:
        """Every task's cost for a ``chunks``-chunk prompt after a past of ``past_chunks`` chunks.
        ``last_rows``: the last chunk's rows as a share of a chunk's (a tail program's chunk), whose
        tasks are priced in proportion: their work is per row, also the attention's."""
        out: dict = dict(self.static)
        for step in self.dynamic:
            for position in range(chunks):
                out[(step, position)] = self.cost(step, position + past_chunks)
        if last_rows != 1.0:
            last = chunks - 1
            for step in list(self.static) + list(self.dynamic):
                out[(step, last)] = out.get((step, last), self.static.get(step, 0.0)) * last_rows
        return out

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"version": VERSION, "static": self.static, "dynamic": self.dynamic}))

    @classmethod
    def from_dict(cls, d: dict, program: ChunkProgram) -> "Profile":
        """A stored profile, checked against ``program``: every step once, static ones as static,
        finite non-negative seconds. Raises ValueError naming the first problem."""
        if not isinstance(d, dict) or not isinstance(d.get("static"), dict) or not isinstance(d.get("dynamic"), dict):
            raise ValueError("not a profile (no static/dynamic tables)")
        static = {int(k): _seconds(v) for k, v in d["static"].items()}
        dynamic = {int(k): [_seconds(x) for x in v] for k, v in d["dynamic"].items()}
        want_static = {i for i, s in enumerate(program.steps) if s.static}
        want_dynamic = set(range(len(program.steps))) - want_static
        if set(static) != want_static or set(dynamic) != want_dynamic or not all(dynamic.values()):
            raise ValueError("its steps are not this program's")
        return cls(static, dynamic)

    @classmethod
    def load(cls, path: Path, program: ChunkProgram) -> "Profile | None":
        """The stored profile, or None when missing, or damaged, foreign or of another version (then
        with a warning): the engine profiles again."""
        path = Path(path)
        if not path.exists():
            return None
        try:
            d = json.loads(path.read_text())
            if not isinstance(d, dict) or d.get("version") != VERSION:
                raise ValueError(f"format version {d.get('version') if isinstance(d, dict) else None}, not {VERSION}")
            return cls.from_dict(d, program)
        except (OSError, ValueError, TypeError, AttributeError) as e:
            log.warning("schedule profile %s is unusable (%s): profiling again", path, e)
            return None


def _seconds(v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{v!r} is not a time in seconds")
    return float(v)
