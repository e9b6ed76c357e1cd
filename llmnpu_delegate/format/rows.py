"""The shadow path's float rows of W^T: hot rows resident, cold rows in a rows file, read when hit.

A shadowed linear saturates its INT8 input at ``clip``; the shadow product adds back
``(x - clip(x)) @ W^T`` over the input channels that crossed it. Calibration shows a few channels
produce most outliers, so only their rows stay in RAM (or in the program); a rare outlier elsewhere
reads its row from the rows file (the paper keeps them on disk likewise).

One layout serves the engine's cache and the ``.pte``'s rows file: one block per shadowed linear of
``[cold channels, out_features]`` rows, at the byte offset its description (``write_cold_rows``'s
return, the sidecar's ``shadow`` entry) gives, in little-endian ``rows_dtype``:
- ``float32``: the engine's cache, which it maps;
- ``float16``: half the bytes, its rounding a 2^-11 part of a rare outlier's share of the product;
- ``int8``: a program's rows (the default): the linear's own INT8 weight codes, per output channel
  as its INT8 GEMM quantizes them (``kernels.quantize_weight``), with the block's ``out_features``
  float32 scales (at ``scales_offset``, 4-byte aligned); a row is ``code * scale``, one rounding. A
  quarter of float32's bytes, at an accuracy cost within measurement noise (docs/results.md, "Cold
  shadow rows as INT8 codes").

A program whose XNNPACK methods store a linear's weight as the rows of W^T (``lower/xnnpack_forms.
int8_weights_as_rows``: the decode step, float-output NPU methods) holds those very codes and
scales: that linear's entry then says ``"rows_in": "program"``, its offsets are into the ``.pte``,
and its rows are indexed by input channel (row ``c`` at ``rows_offset + c * out_features``), every
channel's row being there. A rows file holds only the linears the program does not; a program
whose linears are all in it has none.

``RowStore`` serves one linear's rows and its product; ``ColdRows`` is a program's rows file, one
store per linear, whose rows are read when hit and not kept (``FileRows``), as the native runner
reads them.
"""
from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..kernels import outlier_product_in_order
from ..kernels.ops import gather_rows, quantize_weight, shadow_product, shadow_product_add_
from ..paths import atomic_path, file_sha256

ROW_DTYPES = {"float32": "<f4", "float16": "<f2", "int8": "i1"}     # a rows file's dtype -> its numpy type
PROGRAM_ROW_DTYPE = "int8"


def write_cold_rows(blocks: dict[str, tuple[Tensor, list[int], float]], path: Path, dtype: str = "float32",
                    program_rows: dict[str, dict] | None = None) -> dict:
    """Write each shadowed linear's cold rows (``blocks``: name -> (W [N, K], its cold input channels,
    its clip threshold)) one block after another into ``path`` (atomically) as ``dtype``, except the
    linears in ``program_rows`` (name -> the ``rows_offset`` and ``scales_offset`` of its INT8 W^T rows
    and scales in the program; ``dtype`` int8 only); returns the description: the sidecar's
    ``shadow`` entry. No file is written when every linear is in the program."""
    program_rows = program_rows or {}
    if program_rows and dtype != "int8":
        raise LlmNpuError(f"a program holds INT8 rows; cold rows of type {dtype} go to a rows file")
    linears, offset = {}, 0
    to_file = {name: block for name, block in blocks.items() if name not in program_rows}
    for name, (w, cold, clip) in blocks.items():
        linears[name] = {"cold_channels": [int(c) for c in cold], "in_features": w.shape[1],
                         "out_features": w.shape[0], "clip": clip}
        if name in program_rows:
            linears[name].update(rows_in="program", rows_offset=int(program_rows[name]["rows_offset"]),
                                 scales_offset=int(program_rows[name]["scales_offset"]))
    desc = {"form": "sparse", "rows_dtype": dtype, "linears": linears}
    if not to_file:
        return desc
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        for name, (w, cold, clip) in to_file.items():
            w, entry = w.detach().float(), linears[name]
            if dtype == "int8":
                q, scale = quantize_weight(w, "channel")
                f.write(scale.numpy().astype("<f4").tobytes())
                entry["scales_offset"], offset = offset, offset + 4 * w.shape[0]
                block = q.t()[list(cold)].contiguous().numpy()                           # [cold, N] codes
            else:
                block = w.t()[list(cold)].contiguous().numpy().astype(ROW_DTYPES[dtype])   # [cold, N]
            f.write(block.tobytes())
            entry["rows_offset"], offset = offset, offset + block.nbytes
            pad = -offset % 4                                    # the next block's scales stay aligned
            f.write(b"\0" * pad)
            offset += pad
    return {**desc, "rows_file": path.name, "bytes": offset, "rows_sha256": file_sha256(path)}


def in_program(lin: dict) -> bool:
    """Whether a linear's rows (a sidecar ``shadow.linears`` entry) are the program's own bytes."""
    return lin.get("rows_in") == "program"


def other_channels(channels: Tensor, in_features: int) -> Tensor:
    """The input channels not in ``channels``, sorted: a linear's cold channels given its hot ones."""
    rest = torch.ones(in_features, dtype=torch.bool)
    rest[channels.to(torch.int64)] = False
    return torch.nonzero(rest).flatten()


def map_rows(path: Path, nbytes: int) -> Tensor | None:
    """The rows file as a flat read-only float tensor over its mapping: nothing is read until used."""
    if not nbytes:
        return None
    with warnings.catch_warnings():        # the mapping is read-only, and so is every use of it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(np.memmap(path, dtype="<f4", mode="r"))


class FileRows:
    """A [count, n] block of rows (``dtype``) at byte ``offset`` of an open file, read as float32 when
    indexed and not kept: a mapping would leave every row ever hit resident (most of the file after a
    long prompt). INT8 rows are scaled by the block's ``n`` scales at ``scales_offset``, read once.
    ``rows``: where each of the ``count`` rows lies in the block, in rows (a program's W^T holds every
    input channel's row: the cold channels themselves); None for the rows file's 0, 1, 2, ..."""

    def __init__(self, fd: int, offset: int, count: int, n: int, dtype: str, scales_offset: int | None = None,
                 rows: list[int] | None = None):
        self.fd, self.offset, self.shape, self.dtype = fd, offset, (count, n), np.dtype(ROW_DTYPES[dtype])
        self.at = rows
        self.scales = None
        if dtype == "int8":
            data = os.pread(fd, 4 * n, scales_offset)
            if len(data) != 4 * n:
                raise LlmNpuError("the rows file ended early (in a block's scales): export again")
            self.scales = np.frombuffer(data, dtype="<f4")

    def __getitem__(self, slots: Tensor) -> Tensor:
        row = self.shape[1] * self.dtype.itemsize
        at = slots.tolist() if self.at is None else [self.at[s] for s in slots.tolist()]
        data = b"".join(os.pread(self.fd, row, self.offset + r * row) for r in at)
        if len(data) != slots.numel() * row:
            raise LlmNpuError(f"the rows file ended early (read {len(data)} of {slots.numel() * row} bytes): "
                              f"export again")
        rows = np.frombuffer(data, dtype=self.dtype).astype(np.float32)    # float16 -> float32 is exact
        rows = rows.reshape(slots.numel(), self.shape[1])
        if self.scales is not None:
            rows = rows * self.scales                                       # code * scale: one rounding
        return torch.from_numpy(rows)


class RowStore:
    """One linear's rows of W^T [K, N]: the ``hot`` channels' rows in RAM (``hot_rows``, or None when
    the program holds them), the ``cold`` channels' rows in ``cold_rows`` (a view of the mapped rows
    file). Counts the rows it serves from RAM and from disk."""

    def __init__(self, in_features: int, out_features: int, hot: Tensor, hot_rows: Tensor | None,
                 cold: Tensor, cold_rows: Tensor | FileRows | None):
        self.in_features, self.out_features = in_features, out_features
        self.hot, self.cold = hot.to(torch.int64), cold.to(torch.int64)
        self.hot_rows = hot_rows
        empty = torch.empty(0, out_features)
        self._hot = hot_rows if hot_rows is not None else empty
        self._cold = cold_rows if cold_rows is not None else empty
        if tuple(self._cold.shape) != (self.cold.numel(), out_features):
            raise ValueError(f"cold rows are {tuple(self._cold.shape)}, not [{self.cold.numel()}, {out_features}]")
        self.slot = torch.full((in_features,), -1 - in_features, dtype=torch.int64)   # out of both tables
        if hot_rows is not None:
            self.slot[self.hot] = torch.arange(self.hot.numel())
        self.slot[self.cold] = -1 - torch.arange(self.cold.numel())
        self._hits = self._fetches = 0
        self._uncounted: list[Tensor] = []
        self._is_cold = (self.slot < 0).numpy()

    @property
    def resident_bytes(self) -> int:
        return self._hot.numel() * self._hot.element_size()

    # Counted when read: four small tensor ops per product (~10 us, with the GIL held) are a tenth of
    # a product's own time, paid on the prefill's critical path. A runner settles its stores after
    # each prompt (``settle``): the lists kept until then are small tensors scattered through the
    # heap among a prefill's large temporaries, and kept across prompts they fragment it.
    COUNT_EVERY = 512

    def count(self, channels: Tensor) -> None:
        self._uncounted.append(channels)
        if len(self._uncounted) >= self.COUNT_EVERY:
            self.settle()

    def settle(self) -> None:
        """Count the channels read since the last count, and let go of their lists."""
        pending, self._uncounted = self._uncounted, []
        if pending:    # on numpy: a store's settling costs ~8 us, against ~22 on torch ops
            channels = np.concatenate([c.numpy() for c in pending])
            cold = int(np.count_nonzero(self._is_cold[channels]))
            self._fetches += cold
            self._hits += channels.size - cold

    @property
    def hot_hits(self) -> int:
        """Rows served from RAM."""
        self.settle()
        return self._hits

    @property
    def cold_fetches(self) -> int:
        """Rows read from disk."""
        self.settle()
        return self._fetches

    def reset_counts(self) -> None:
        self._uncounted, self._hits, self._fetches = [], 0, 0

    def rows(self, channels: Tensor) -> Tensor:
        """W^T[channels] as a [k, N] float tensor."""
        self.count(channels)
        return gather_rows(self._hot, self._cold, self.slot[channels])

    def product(self, x: Tensor, clip: float) -> tuple[Tensor | None, int]:
        """``(x - clip(x)) @ W^T`` for ``x`` [M, K] over every channel that crossed ``clip`` (None when
        none did) and the number of outlier elements: one pass, one row per outlier."""
        self._check_held()
        y, channels, outliers = shadow_product(x, clip, self._hot, self._cold, self.slot)
        if outliers == 0:
            return None, 0
        self.count(channels)
        return y, outliers

    def add_product_(self, y: Tensor, x: Tensor, clip: float) -> int:
        """``y += (x - clip(x)) @ W^T`` in place (``y`` [M, N] contiguous float, ``x`` [M, K]); returns
        the number of outlier elements."""
        self._check_held()
        channels, outliers = shadow_product_add_(y, x, clip, self._hot, self._cold, self.slot)
        self.count(channels)
        return outliers

    def _check_held(self) -> None:
        if self.hot_rows is None and self.hot.numel():
            raise ValueError("this store does not hold its hot rows (the program does): use cold_product")

    def cold_product(self, x: Tensor, clip: float, hits: Tensor) -> Tensor | None:
        """The cold part only, ``(x - clip(x))[:, c] @ W^T[c]`` over the cold channels ``c`` that
        ``hits`` [K] flags (a program's hot channels ran inside it), or None."""
        hit = self.cold[hits[self.cold] > 0]
        if hit.numel() == 0:
            return None
        x2 = x.reshape(-1, x.shape[-1])
        cols = x2.index_select(1, hit)
        return outlier_product_in_order(cols - cols.clamp(-clip, clip), self.rows(hit)).view(*x.shape[:-1], self.out_features)


def row_stores(rows: Tensor | int | None, shadow: dict,
               hot_rows: dict[str, tuple[Tensor, Tensor]] | None = None, program: int | None = None) -> dict[str, RowStore]:
    """A store per linear of a rows file's description ``shadow`` over its mapped ``rows`` (or an open
    file descriptor: rows read when hit; ``program``: the open ``.pte``, for the linears whose rows
    it holds); ``hot_rows`` (name -> (hot channels, their rows)) when RAM holds them, else the hot
    channels are the rest."""
    stores = {}
    for name, lin in shadow["linears"].items():
        k, n = lin["in_features"], lin["out_features"]
        cold = torch.tensor(lin["cold_channels"], dtype=torch.int64)
        if not cold.numel() or (rows is None and not in_program(lin)):
            block = None
        elif in_program(lin):
            block = FileRows(program, lin["rows_offset"], cold.numel(), n, shadow["rows_dtype"], lin["scales_offset"],
                             lin["cold_channels"])
        elif isinstance(rows, int):
            block = FileRows(rows, lin["rows_offset"], cold.numel(), n, shadow["rows_dtype"], lin.get("scales_offset"))
        else:                                   # the engine's float32 cache, mapped
            start = lin["rows_offset"] // 4
            block = rows[start:start + cold.numel() * n].view(cold.numel(), n)
        if hot_rows is not None:
            hot, held = hot_rows[name]
        else:
            hot, held = other_channels(cold, k), None
        stores[name] = RowStore(k, n, hot, held, cold, block)
    return stores


class ColdRows:
    """A program's cold rows, checked against the sidecar's ``shadow`` entry and held open, read when
    hit: those in the rows file beside the ``.pte`` (``path``) and those in the ``.pte`` itself
    (``program``). The hot rows are in the program's methods, so only the cold part runs here."""

    def __init__(self, path: Path | None, shadow: dict, program: Path | None = None):
        self.stores: dict[str, RowStore] = {}
        self.clips: dict[str, float] = {}
        self._fds: list[int] = []
        if shadow.get("form") != "sparse":
            return
        rows = program_fd = None
        if "rows_file" in shadow:
            if path is None or not Path(path).is_file():
                raise LlmNpuError(f"the program's cold rows file {shadow['rows_file']} is missing: copy it with the .pte")
            if Path(path).stat().st_size != shadow["bytes"] or file_sha256(Path(path)) != shadow["rows_sha256"]:
                raise LlmNpuError(f"{path} does not belong to this program (size or digest differ): export again")
            rows = self._open(path)
        held = {name: lin for name, lin in shadow["linears"].items() if in_program(lin)}
        if held:
            if program is None or not Path(program).is_file():
                raise LlmNpuError("the sidecar reads cold rows from the program, and no .pte was given")
            size = Path(program).stat().st_size
            for name, lin in held.items():
                n = lin["out_features"]
                if not (0 <= lin["rows_offset"] and lin["rows_offset"] + lin["in_features"] * n <= size
                        and 0 <= lin["scales_offset"] and lin["scales_offset"] + 4 * n <= size):
                    raise LlmNpuError(f"the sidecar's cold rows of {name} lie outside {program}: export again")
            program_fd = self._open(program)
        self.stores = row_stores(rows, shadow, program=program_fd)
        self.clips = {name: lin["clip"] for name, lin in shadow["linears"].items()}

    def _open(self, path: Path) -> int:
        self._fds.append(os.open(path, os.O_RDONLY))
        return self._fds[-1]

    def __del__(self):
        for fd in getattr(self, "_fds", ()):
            os.close(fd)

    @property
    def fetched(self) -> int:
        return sum(s.cold_fetches for s in self.stores.values())

    def product(self, name: str, x: Tensor, hits: Tensor) -> Tensor | None:
        """``(x - clip(x))[:, hit] @ W^T[hit]`` over the cold channels that ``hits`` flags, or None."""
        return self.stores[name].cold_product(x, self.clips[name], hits)
