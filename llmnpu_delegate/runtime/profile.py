"""Offline profile of each subgraph's time on its processor, for the out-of-order policy.

Static subgraphs cost the same at every chunk position (median over positions); a dynamic one
(attention) grows with the keys it reads, so its cost is kept per position and extrapolated in
proportion to the key count beyond the profiled positions. Stored as JSON next to the graph cache.
"""
from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path

from ..paths import atomic_path
from .program import ChunkProgram

VERSION = 1


@dataclass
class Profile:
    static: dict[int, float]            # step -> seconds
    dynamic: dict[int, list[float]]     # step -> seconds at chunk positions 0, 1, ...

    @classmethod
    def from_records(cls, records, program: ChunkProgram, chunk_len: int) -> "Profile":
        per: dict[int, dict[int, float]] = {}
        for r in records:
            per.setdefault(r.step, {})[r.chunk] = r.end - r.start
        static, dynamic = {}, {}
        for step, times in per.items():
            if program.steps[step].static:
                static[step] = statistics.median(times.values())
            else:
                dynamic[step] = [times[p] for p in sorted(times)]
        return cls(static, dynamic)

    def cost(self, step: int, position: int) -> float:
        if step in self.static:
            return self.static[step]
        times = self.dynamic.get(step)
        if not times:
            return 0.0
        if position < len(times):
            return times[position]
        return times[-1] * (position + 1) / len(times)   # attention reads (position + 1) chunks of keys

    def costs(self, chunks: int) -> dict:
        out: dict = dict(self.static)
        for step in self.dynamic:
            for position in range(chunks):
                out[(step, position)] = self.cost(step, position)
        return out

    def save(self, path: Path) -> None:
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"version": VERSION, "static": self.static, "dynamic": self.dynamic}))

    @classmethod
    def load(cls, path: Path) -> "Profile | None":
        """The stored profile, or None when missing, damaged or of another version (then re-profiled)."""
        try:
            d = json.loads(Path(path).read_text())
            if d.get("version") != VERSION:
                return None
            return cls({int(k): float(v) for k, v in d["static"].items()},
                       {int(k): [float(x) for x in v] for k, v in d["dynamic"].items()})
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return None
