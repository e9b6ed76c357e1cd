"""The prefix cache: K/V of earlier prompts, so that a prompt starting with one prefills only the rest.

The paper's motivating workloads send mostly the same tokens again: a UI agent its fixed instructions
before every new screen, a chat its whole history before every new question. A prompt's K/V at
position ``t`` depend only on tokens ``0..t``, so any entry that shares the first ``n`` tokens of a
new prompt gives that prompt's K/V for those ``n`` tokens, at token granularity (the chunk graphs
take any past length: ``runtime/prompt.py``). At least the prompt's last token is always computed:
its logits are what the caller wants.

Entries are keyed by the runner's ``key`` (the model's fingerprint, its quantization plan and
program: an entry of another model or configuration is never used) and their token ids. They are
held in memory under a byte budget, least recently used first out, and optionally on disk (checked
files written atomically, the rules of every other cache here), so a new process resumes a
conversation without prefilling its instructions again. An entry whose tokens are a prefix of a newer
one's is dropped for it: a conversation keeps one entry, its latest prompt.
"""
from __future__ import annotations

import hashlib
import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..paths import DamagedFile, load_checked, save_checked

log = logging.getLogger(__name__)

DEFAULT_BYTES = 256 << 20          # in memory: ~5,500 tokens of the embedded model's K/V
DEFAULT_DISK_BYTES = 2 << 30
_KIND = "prefix-kv"
_FORMAT = 1


@dataclass
class Hit:
    """The first ``tokens`` tokens of a prompt were cached: their K/V, per layer [1, KVH, tokens, d]."""
    tokens: int
    past_k: list[Tensor]
    past_v: list[Tensor]


@dataclass
class _Entry:
    key: str
    ids: Tensor
    k: list[Tensor]
    v: list[Tensor]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


@dataclass
class PrefixStats:
    lookups: int = 0
    hits: int = 0
    reused_tokens: int = 0
    stored: int = 0
    evicted: int = 0
    damaged: int = 0          # disk entries found damaged (dropped, warned)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def common_prefix(a: Tensor, b: Tensor) -> int:
    """How many leading tokens two 1-D id tensors share."""
    n = min(a.numel(), b.numel())
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if differ.numel() else n


def _digest(ids: Tensor) -> str:
    return hashlib.sha256(ids.to(torch.int64).numpy().tobytes()).hexdigest()[:32]


@dataclass
class PrefixCache:
    """K/V of earlier prompts, per runner key: in memory under ``max_bytes`` (0: none in memory) and,
    with ``directory``, on disk under ``disk_bytes``."""
    max_bytes: int = DEFAULT_BYTES
    directory: Path | str | None = None
    disk_bytes: int = DEFAULT_DISK_BYTES
    stats: PrefixStats = field(default_factory=PrefixStats)

    def __post_init__(self):
        for name in ("max_bytes", "disk_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise LlmNpuError(f"prefix cache {name} must be a whole number of bytes >= 0, got {value!r}")
        if self.directory is not None:
            self.directory = Path(self.directory)
            try:
                self.directory.mkdir(parents=True, exist_ok=True)
            except OSError as e:
                raise LlmNpuError(f"cannot use {self.directory} as the K/V cache folder ({e.strerror}): "
                                  "give a writable --kv-cache-dir") from None
        self._memory: OrderedDict[tuple[str, str], _Entry] = OrderedDict()

    # ------------------------------------------------------------------ lookup
    def lookup(self, key: str, ids: Tensor) -> Hit | None:
        """The longest cached prefix of ``ids`` (1-D) under ``key``, short of its last token, or None."""
        self.stats.lookups += 1
        want = ids.numel() - 1
        best, best_n = None, 0
        for name, entry in self._memory.items():
            if entry.key == key:
                n = min(common_prefix(entry.ids, ids), want)
                if n > best_n:
                    best, best_n = name, n
        entry = self._memory.get(best) if best is not None else None
        if entry is not None:
            self._memory.move_to_end(best)
        for path, disk_ids in self._disk_index(key):
            n = min(common_prefix(disk_ids, ids), want)
            if n > best_n:
                loaded = self._load(key, path, disk_ids)
                if loaded is not None:
                    entry, best_n = loaded, n
        if entry is None or best_n == 0:
            return None
        self.stats.hits += 1
        self.stats.reused_tokens += best_n
        return Hit(best_n, [k[:, :, :best_n] for k in entry.k], [v[:, :, :best_n] for v in entry.v])

    def prefill(self, key: str, ids: Tensor, run):
        """A runner's prefill of ``ids`` through the cache: ``run(ids, past)`` prefills the tokens
        after the longest cached prefix (``past`` None when nothing is cached), and the whole
        prompt's K/V are kept. Every runner with a prefix cache (the engine, the ``.pte`` runner)
        goes through here."""
        hit = self.lookup(key, ids)
        result = run(ids, None) if hit is None else run(ids[hit.tokens:], (hit.past_k, hit.past_v))
        self.store(key, ids, result.past_k, result.past_v)
        return result

    # ------------------------------------------------------------------ store
    def store(self, key: str, ids: Tensor, past_k: list[Tensor], past_v: list[Tensor]) -> None:
        """Keep the K/V (per layer [1, KVH, T, d]) of the ``T`` tokens ``ids``; copies them."""
        if past_k[0].shape[2] != ids.numel():
            raise ValueError(f"{ids.numel()} ids for K/V of {past_k[0].shape[2]} tokens")
        ids = ids.to(torch.int64).clone()
        for entry in self._memory.values():
            if entry.key == key and common_prefix(entry.ids, ids) == ids.numel():
                return                          # an entry already holds all of it
        entry = _Entry(key, ids, [k.contiguous().clone() for k in past_k], [v.contiguous().clone() for v in past_v])
        for name in [n for n, e in self._memory.items() if e.key == key and common_prefix(e.ids, ids) == e.ids.numel()]:
            del self._memory[name]              # a prefix of the new one: superseded
        self.stats.stored += 1
        if entry.nbytes <= self.max_bytes:
            self._memory[(key, _digest(ids))] = entry
            self._evict()
        if self.directory is not None:
            self._save(entry)

    def _evict(self) -> None:
        while self._memory and self.bytes > self.max_bytes:
            self._memory.popitem(last=False)
            self.stats.evicted += 1

    @property
    def bytes(self) -> int:
        """Bytes of K/V held in memory."""
        return sum(e.nbytes for e in self._memory.values())

    def __len__(self) -> int:
        return len(self._memory)

    def clear(self) -> None:
        """Forget every entry in memory (disk entries stay)."""
        self._memory.clear()

    # ------------------------------------------------------------------ disk
    def _folder(self, key: str) -> Path:
        return self.directory / hashlib.sha256(key.encode()).hexdigest()[:24]

    def _disk_index(self, key: str):
        """(K/V file, its ids) of every disk entry under ``key``; ids files are small, read whole."""
        if self.directory is None or not self._folder(key).is_dir():
            return
        for ids_path in sorted(self._folder(key).glob("*.ids")):
            try:
                yield ids_path.with_suffix(".kv"), load_checked(ids_path, _KIND + "-ids")["ids"]
            except (DamagedFile, OSError, KeyError, TypeError) as e:
                self._drop(ids_path.with_suffix(".kv"), e)

    def _load(self, key: str, path: Path, ids: Tensor) -> _Entry | None:
        try:
            d = load_checked(path, _KIND)
            if d.get("format") != _FORMAT or d.get("key") != key or not torch.equal(d.get("ids"), ids):
                raise DamagedFile("it belongs to another key or format")
            entry = _Entry(key, ids, list(d["k"]), list(d["v"]))
            if entry.k[0].shape[2] != ids.numel():
                raise DamagedFile("its K/V and ids disagree in length")
        except (DamagedFile, OSError, KeyError, TypeError, IndexError) as e:
            self._drop(path, e)
            return None
        os.utime(path)                          # recently used: the last to leave the disk
        if entry.nbytes <= self.max_bytes:
            self._memory[(key, _digest(ids))] = entry
            self._evict()
        return entry

    def _drop(self, path: Path, why) -> None:
        self.stats.damaged += 1
        log.warning("K/V cache entry %s is unusable (%s): dropped; its prompt is prefilled again", path.name, why)
        for p in (path, path.with_suffix(".ids")):
            p.unlink(missing_ok=True)

    def _save(self, entry: _Entry) -> None:
        folder = self._folder(entry.key)
        stem = folder / _digest(entry.ids)
        for old_kv, old_ids in list(self._disk_index(entry.key)):
            if common_prefix(old_ids, entry.ids) == old_ids.numel() and old_kv.stem != stem.name:
                for p in (old_kv, old_kv.with_suffix(".ids")):
                    p.unlink(missing_ok=True)    # a prefix of the new one: superseded
        # the K/V first and the index last: a reader never finds an index without its data
        save_checked({"format": _FORMAT, "key": entry.key, "ids": entry.ids, "k": entry.k, "v": entry.v},
                     stem.with_suffix(".kv"), _KIND)
        save_checked({"ids": entry.ids}, stem.with_suffix(".ids"), _KIND + "-ids")
        self._trim_disk()

    def _trim_disk(self) -> None:
        """Oldest entries out (by modification time, every key) until the folder fits ``disk_bytes``."""
        files = sorted(self.directory.glob("*/*.kv"), key=lambda p: p.stat().st_mtime)
        total = sum(p.stat().st_size for p in files)
        for p in files[:-1]:
            if total <= self.disk_bytes:
                break
            total -= p.stat().st_size
            for q in (p.with_suffix(".ids"), p):
                q.unlink(missing_ok=True)
            self.stats.evicted += 1
