"""Float weight rows for the shadow outlier path: hot channels in RAM, the rest memory-mapped.

The shadow matmul ``residue[:, channels] @ W^T[channels]`` needs, for each input channel that
produced an outlier, that channel's row of W^T (float). Calibration shows a few channels produce
most outliers, so only their rows stay in memory; a rare outlier elsewhere reads its row from an
on-disk copy of W^T (a "cold fetch", counted).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..paths import atomic_path, cache_dir


def hot_channels(counts: Tensor, coverage: float) -> Tensor:
    """Smallest set of channels covering ``coverage`` of all outlier hits in ``counts`` [K]."""
    total = int(counts.sum())
    if total == 0 or coverage <= 0:
        return torch.empty(0, dtype=torch.int64)
    order = counts.argsort(descending=True, stable=True)
    covered = counts[order].cumsum(0)
    n = int(torch.searchsorted(covered, torch.tensor(coverage * total), right=False)) + 1
    return order[: min(n, counts.numel())].sort().values


def weight_rows_file(fingerprint: str, name: str, weight: Tensor) -> Path:
    """The on-disk W^T [K, N] float32 of one linear, written once per model (atomically)."""
    path = cache_dir() / "shadow" / fingerprint / f"{name}.npy"
    if not _valid_rows_file(path, (weight.shape[1], weight.shape[0])):  # missing, or damaged: rebuild
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                np.save(f, weight.detach().float().t().contiguous().numpy())
    return path


def _valid_rows_file(path: Path, shape: tuple[int, int]) -> bool:
    try:
        arr = np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        return False
    return arr.shape == shape and arr.dtype == np.float32


class ShadowWeights:
    """Serves rows of W^T for given input channels; counts rows read from disk."""

    def __init__(self, path: Path, hot: Tensor):
        self.path = Path(path)
        self._disk = np.load(self.path, mmap_mode="r")      # [K, N] float32, read lazily
        k = self._disk.shape[0]
        self.hot = hot.to(torch.int64)
        self.hot_rows = torch.from_numpy(np.ascontiguousarray(self._disk[self.hot.numpy()]))  # [h, N]
        self._slot = torch.full((k,), -1, dtype=torch.int64)
        self._slot[self.hot] = torch.arange(self.hot.numel())
        self.cold_fetches = 0    # rows read from disk
        self.hot_hits = 0        # rows served from RAM

    @property
    def resident_bytes(self) -> int:
        return self.hot_rows.numel() * self.hot_rows.element_size()

    def rows(self, channels: Tensor) -> Tensor:
        """W^T[channels] as a [k, N] float tensor."""
        slot = self._slot[channels]
        is_hot = slot >= 0
        n_hot = int(is_hot.sum())
        self.hot_hits += n_hot
        if n_hot == channels.numel():
            return self.hot_rows[slot]
        out = torch.empty(channels.numel(), self._disk.shape[1])
        out[is_hot] = self.hot_rows[slot[is_hot]]
        cold = channels[~is_hot].numpy()
        out[~is_hot] = torch.from_numpy(np.ascontiguousarray(self._disk[cold]))
        self.cold_fetches += cold.size
        return out
