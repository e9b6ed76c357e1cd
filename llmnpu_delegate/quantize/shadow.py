"""Float weight rows for the shadow outlier path: hot channels in RAM, the rest memory-mapped.

The shadow matmul ``residue[:, channels] @ W^T[channels]`` needs, for each input channel that
produced an outlier, that channel's row of W^T (float). Calibration shows a few channels produce
most outliers, so only their rows stay in memory; a rare outlier elsewhere reads its row from an
on-disk copy of W^T (a "cold fetch", counted).
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

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


ROWS_FORMAT = 1
HEADER_BYTES = 256   # a JSON header padded with spaces, then W^T [K, N] little-endian float32


def rows_key(fingerprint: str, name: str, weight: Tensor) -> dict:
    """What a rows file was built for: the model's fingerprint, the linear and its shape."""
    return {"format": ROWS_FORMAT, "model": fingerprint, "linear": name,
            "shape": [int(weight.shape[1]), int(weight.shape[0])], "dtype": "<f4"}


def weight_rows_file(fingerprint: str, name: str, weight: Tensor) -> Path:
    """The on-disk W^T [K, N] float32 of one linear, written once per model (atomically). The file
    carries the key it was built for; a damaged or foreign file is rebuilt, never read."""
    path = cache_dir() / "shadow" / fingerprint / f"{name}.rows"
    key = rows_key(fingerprint, name, weight)
    problem = _rows_file_problem(path, key)
    if problem:
        if path.exists():
            log.warning("shadow rows file %s %s: rebuilding it", path, problem)
        header = json.dumps(key).encode().ljust(HEADER_BYTES)
        with atomic_path(path) as tmp:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(weight.detach().float().t().contiguous().numpy().astype("<f4").tobytes())
    return path


def read_rows_header(path: Path) -> dict:
    with open(path, "rb") as f:
        head = json.loads(f.read(HEADER_BYTES).decode())
    if not isinstance(head, dict) or not isinstance(head.get("shape"), list) or len(head["shape"]) != 2:
        raise ValueError("header is not a rows-file header")
    return head


def _rows_file_problem(path: Path, key: dict) -> str | None:
    if not path.exists():
        return "is missing"
    try:
        head = read_rows_header(path)
    except (OSError, ValueError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return f"is damaged ({type(e).__name__})"
    if head != key:
        return f"was built for {head.get('model')}/{head.get('linear')} {head.get('shape')}, not {key['model']}/{key['linear']} {key['shape']}"
    k, n = key["shape"]
    if path.stat().st_size != HEADER_BYTES + 4 * k * n:
        return "is truncated"
    return None


def shadow_weights(fingerprint: str, name: str, weight: Tensor, hot: Tensor) -> "ShadowWeights":
    """The shadow rows of one linear, its file (re)built for this model when needed. The hot rows
    read back must equal the weight's: a file that lies about its key is caught here too."""
    store = ShadowWeights(weight_rows_file(fingerprint, name, weight), hot)
    if store.hot.numel() and not torch.equal(store.hot_rows, weight.detach().float().t()[store.hot]):
        store.path.unlink()
        log.warning("shadow rows file %s does not hold this linear's weights: rebuilding it", store.path)
        store = ShadowWeights(weight_rows_file(fingerprint, name, weight), hot)
    return store


class ShadowWeights:
    """Serves rows of W^T for given input channels; counts rows read from disk."""

    def __init__(self, path: Path, hot: Tensor):
        self.path = Path(path)
        k, n = read_rows_header(self.path)["shape"]
        self._disk = np.memmap(self.path, dtype="<f4", mode="r", offset=HEADER_BYTES, shape=(k, n))  # read lazily
        self.hot = hot.to(torch.int64)
        self.hot_rows = torch.from_numpy(np.ascontiguousarray(self._disk[self.hot.numpy()]))  # [h, N]
        self._slot = torch.full((k,), -1, dtype=torch.int64)
        self._slot[self.hot] = torch.arange(self.hot.numel())
        self._table: Tensor | None = None
        self.cold_fetches = 0    # rows read from disk
        self.hot_hits = 0        # rows served from RAM

    def table(self) -> Tensor:
        """All of W^T [K, N] as a tensor over the memory-mapped file, without reading it: a sparse
        product reads only the rows of the channels it hits (hot ones stay in the page cache).
        Read-only: never write to it."""
        if self._table is None:
            with warnings.catch_warnings():        # the mapping is read-only, and so is every use of it
                warnings.simplefilter("ignore", UserWarning)
                self._table = torch.from_numpy(self._disk)
        return self._table

    def count(self, channels: Tensor) -> None:
        """Count ``channels`` (input channels a product used) as hot hits or cold fetches."""
        hot = int((self._slot[channels] >= 0).sum())
        self.hot_hits += hot
        self.cold_fetches += channels.numel() - hot

    @property
    def resident_bytes(self) -> int:
        return self.hot_rows.numel() * self.hot_rows.element_size()

    def rows(self, channels: Tensor) -> Tensor:
        """W^T[channels] as a [k, N] float tensor."""
        self.count(channels)
        slot = self._slot[channels]
        is_hot = slot >= 0
        if bool(is_hot.all()):
            return self.hot_rows[slot]
        out = torch.empty(channels.numel(), self._disk.shape[1])
        out[is_hot] = self.hot_rows[slot[is_hot]]
        out[~is_hot] = torch.from_numpy(np.ascontiguousarray(self._disk[channels[~is_hot].numpy()]))
        return out
