"""The engine's shadow rows: hot channels' rows in RAM, the rest in this model's rows file in the cache.

The shadow matmul ``residue[:, channels] @ W^T[channels]`` needs, for each input channel that
produced an outlier, that channel's row of W^T (float). Calibration shows a few channels produce
most outliers (``hot_channels``): their rows are copied into RAM; the others are written once per
model and hot set to a rows file (``format/rows.py``'s layout, the one the ``.pte``'s rows file has)
and read from it on demand (a "cold fetch", counted).
"""
from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

import torch
from torch import Tensor

from ..format.rows import RowStore, map_rows, other_channels, row_stores, write_cold_rows
from ..kernels.ops import SPARSE_BELOW
from ..paths import atomic_path, cache_dir

log = logging.getLogger(__name__)


def hot_channels(counts: Tensor, coverage: float) -> Tensor:
    """Smallest set of channels covering ``coverage`` of all outlier hits in ``counts`` [K]."""
    total = int(counts.sum())
    if total == 0 or coverage <= 0:
        return torch.empty(0, dtype=torch.int64)
    order = counts.argsort(descending=True, stable=True)
    covered = counts[order].cumsum(0)
    n = int(torch.searchsorted(covered, torch.tensor(coverage * total), right=False)) + 1
    return order[: min(n, counts.numel())].sort().values


def dense_channels(counts: Tensor, elements: int) -> Tensor:
    """Channels that crossed the threshold in at least ``SPARSE_BELOW`` of the calibration tokens
    (``counts`` [K] outliers per channel over ``elements`` values): where a dense product over the
    whole chunk costs less than one per outlier. A static program multiplies only these densely;
    the scattered rest (most channels of most linears, each hit a few times a chunk) goes one row
    per hit, read from its rows file."""
    tokens = max(elements // max(counts.numel(), 1), 1)
    return torch.nonzero(counts >= SPARSE_BELOW * tokens).flatten()


PEAK_CHANNELS = 32   # a norm reader's static set: within 0.1-0.6 dB of every channel's product (docs/results.md)


def peak_channels(channel_absmax: Tensor, clip: float, weight: Tensor, count: int) -> Tensor:
    """The ``count`` input channels whose calibrated peak, clipped, would cost the output most,
    ``(absmax - clip) * ||W[:, c]||``, in order; channels that never crossed the clip left out. The
    static set an NPU graph multiplies in 16 bits (placement piece ``peak``)."""
    cost = (channel_absmax.float() - clip).clamp(min=0) * weight.detach().float().norm(dim=0)
    order = cost.argsort(descending=True)[:count]
    return order[cost[order] > 0].sort().values


def rows_files(fingerprint: str, name: str, hot: Tensor) -> tuple[Path, Path]:
    """The rows file of one linear of one model with one hot set, and its description beside it."""
    digest = hashlib.sha256(hot.to(torch.int64).numpy().tobytes()).hexdigest()[:16]
    base = cache_dir() / "shadow" / fingerprint / f"{name}.{digest}"
    return base.with_name(base.name + ".rows.bin"), base.with_name(base.name + ".rows.json")


def shadow_rows(fingerprint: str, name: str, weight: Tensor, hot: Tensor) -> RowStore:
    """One linear's shadow rows: the hot ones copied from ``weight`` [N, K], the cold ones from the
    rows file, written (atomically) when missing, damaged or not this linear's: never read then."""
    rows, desc_path = rows_files(fingerprint, name, hot)
    w = weight.detach().float()
    cold = other_channels(hot, w.shape[1]).tolist()
    problem, desc = _rows_problem(rows, desc_path, fingerprint, name, w, cold)
    if problem:
        if desc_path.exists() or rows.exists():
            log.warning("shadow rows file %s %s: rebuilding it", rows, problem)
        desc = {"model": fingerprint, **write_cold_rows({name: (w, cold, None)}, rows)}
        with atomic_path(desc_path) as tmp:
            tmp.write_text(json.dumps(desc))
    hot = hot.to(torch.int64)
    return row_stores(map_rows(rows, desc["bytes"]), desc, {name: (hot, w.t()[hot].contiguous())})[name]


def _rows_problem(rows: Path, desc_path: Path, fingerprint: str, name: str, w: Tensor,
                  cold: list[int]) -> tuple[str | None, dict | None]:
    """(why the cached rows file cannot be used, or None; its description when it can)."""
    if not rows.exists() or not desc_path.exists():
        return "is missing", None
    try:
        desc = json.loads(desc_path.read_text())
        lin = desc["linears"][name]
        built = (desc["model"], sorted(desc["linears"]), lin["cold_channels"], lin["out_features"], lin["in_features"])
    except (OSError, ValueError, KeyError, TypeError) as e:   # JSONDecodeError is a ValueError
        return f"has a damaged description ({type(e).__name__})", None
    n, k = w.shape
    if built != (fingerprint, [name], cold, n, k):
        return f"was built for {desc['model']}/{sorted(desc['linears'])}, not {fingerprint}/{name} with this hot set", None
    if rows.stat().st_size != desc["bytes"] or desc["bytes"] != 4 * n * len(cold):
        return "is truncated", None
    # The whole file's digest would read every row; its first and last rows catch a file of other weights.
    if cold:
        mapped = map_rows(rows, desc["bytes"]).view(len(cold), n)
        if not (torch.equal(mapped[0], w[:, cold[0]]) and torch.equal(mapped[-1], w[:, cold[-1]])):
            return "does not hold this linear's weights", None
    return None, desc
