"""The cold rows file: the float rows of W^T that a shadowed linear's program does not hold.

A sparse shadow branch multiplies only its hot input channels' rows (kept in the program); when a
cold channel crosses its threshold, the runner reads that channel's row from this file (the paper
keeps them on disk likewise). Layout: little-endian float32, one block per shadowed linear of
``[cold channels, out_features]`` rows, at the byte offset the sidecar's ``shadow.linears`` gives.
"""
from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..kernels import outlier_product
from ..paths import atomic_path

ROW_DTYPE = "float32"


def write_cold_rows(blocks: dict[str, tuple[Tensor, list[int], float]], path: Path) -> dict:
    """Write each shadowed linear's cold rows (``blocks``: name -> (W [N, K], its cold input channels,
    its clip threshold)) one block after another into ``path``; returns the sidecar's ``shadow`` entry."""
    linears, offset = {}, 0
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for name, (w, cold, clip) in blocks.items():
            w = w.detach().float()
            block = w.t()[cold].contiguous().numpy().astype("<f4")           # [cold, N]
            f.write(block.tobytes())
            linears[name] = {"cold_channels": list(cold), "rows_offset": offset, "in_features": w.shape[1],
                             "out_features": w.shape[0], "clip": clip}
            offset += block.nbytes
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"form": "sparse", "rows_file": path.name, "rows_dtype": ROW_DTYPE, "bytes": offset, "rows_sha256": digest,
            "linears": linears}


class ColdRows:
    """The cold channels' float rows of W^T (the rows file beside the ``.pte``), memory-mapped and
    read when a channel is hit; counts the rows read. ``shadow``: the sidecar's ``shadow`` entry."""

    def __init__(self, path: Path | None, shadow: dict):
        self.linears: dict[str, tuple] = {}
        self.fetched = 0
        self._file = None
        if shadow.get("form") != "sparse":
            return
        if path is None or not Path(path).is_file():
            raise LlmNpuError(f"the program's cold rows file {shadow['rows_file']} is missing: copy it with the .pte")
        if Path(path).stat().st_size != shadow["bytes"] or hashlib.sha256(Path(path).read_bytes()).hexdigest() != shadow["rows_sha256"]:
            raise LlmNpuError(f"{path} does not belong to this program (size or digest differ): export again")
        if shadow["bytes"]:
            self._file = np.memmap(path, dtype="<f4", mode="r")
        for name, lin in shadow["linears"].items():
            cold = torch.tensor(lin["cold_channels"], dtype=torch.int64)
            slot = torch.full((lin["in_features"],), -1, dtype=torch.int64)
            slot[cold] = torch.arange(cold.numel())
            self.linears[name] = (cold, slot, lin["rows_offset"] // 4, lin["out_features"], lin["clip"])

    def product(self, name: str, x: Tensor, hits: Tensor) -> Tensor | None:
        """``(x - clip(x))[:, hit] @ W^T[hit]`` over the cold channels that ``hits`` flags, or None."""
        cold, slot, start, n, clip = self.linears[name]
        hit = cold[hits[cold] > 0]
        if hit.numel() == 0:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        cols = x2.index_select(1, hit)
        residue = cols - cols.clamp(-clip, clip)
        block = self._file[start:start + cold.numel() * n].reshape(cold.numel(), n)
        rows = torch.from_numpy(np.ascontiguousarray(block[slot[hit].numpy()]))
        self.fetched += hit.numel()
        return outlier_product(residue, rows).view(*x.shape[:-1], n)
