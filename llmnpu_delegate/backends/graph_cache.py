"""The chunk-sharing graph cache: compiled static subgraphs on disk, content-addressed.

An entry is keyed by a hash of everything its compiled form depends on (backend, model weights'
fingerprint, chunk length, quantization decisions, the subgraph's linears, this format's version),
so a changed model, config or release never reads a stale entry: it gets a new key. Entries are
written to a temporary name and renamed: two processes compiling the same subgraph at once both
end with a complete file (the last rename wins; both wrote the same content). A damaged entry is
detected on load (unreadable, altered: its checksum fails, its header names another key, or its
payload fails the builder's ``check``) and rebuilt, with a warning.
"""
from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from ..paths import cache_dir, load_checked, save_checked

FORMAT = 3    # of a cached entry's layout; another is compiled again (CHANGELOG.md: what changed)
KIND = "graph-cache-entry"
log = logging.getLogger(__name__)


def entry_key(fields: dict) -> str:
    blob = json.dumps({"format": FORMAT, **fields}, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:32]


def payload_bytes(payload) -> int:
    leaves = torch.utils._pytree.tree_leaves(payload)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))


@dataclass
class CacheStats:
    compilations: int = 0     # subgraphs compiled in this process
    hits: int = 0             # subgraphs loaded from disk or memory instead
    rebuilt: int = 0          # damaged or foreign entries found on disk and replaced
    bytes_held: int = 0       # compiled payloads held in memory

    def to_dict(self) -> dict:
        return dict(vars(self))


class GraphCache:
    """Compiled subgraph payloads (pytrees of tensors and plain values), in memory and on disk."""

    def __init__(self, root: Path | None = None):
        self.root = Path(root) if root else cache_dir() / "graphs"
        self.stats = CacheStats()
        self._memory: dict[str, object] = {}

    def forget(self) -> None:
        """Drop the payloads held in memory (the disk keeps them)."""
        self._memory.clear()
        self.stats.bytes_held = 0

    def path(self, key: str) -> Path:
        return self.root / f"{key}.pt"

    def get_or_build(self, fields: dict, build: Callable[[], object], check: Callable[[object], None] | None = None):
        """The payload for ``fields``: from memory, from disk, or ``build()`` (then stored). ``check``
        raises on a payload of the wrong structure (a disk entry that fails it is rebuilt)."""
        key = entry_key(fields)
        if key in self._memory:
            self.stats.hits += 1
            return self._memory[key]
        payload = self._load(key, check)
        if payload is None:
            payload = build()
            self.stats.compilations += 1
            save_checked({"format": FORMAT, "key": key, "payload": payload}, self.path(key), KIND)
        else:
            self.stats.hits += 1
        self._memory[key] = payload
        self.stats.bytes_held += payload_bytes(payload)
        return payload

    def _load(self, key: str, check: Callable[[object], None] | None):
        path = self.path(key)
        if not path.exists():
            return None
        try:
            entry = load_checked(path, KIND)
            if not isinstance(entry, dict) or entry.get("key") != key:
                raise ValueError("header does not match the entry's name")
            if entry.get("format") != FORMAT:
                raise ValueError(f"written by cache format {entry.get('format')}, this is {FORMAT}")
            if check is not None:
                check(entry["payload"])
            return entry["payload"]
        except Exception as e:  # unreadable for any reason: the entry is rebuilt, never trusted
            log.warning("graph cache entry %s is damaged (%s): rebuilding it", path.name, e)
            self.stats.rebuilt += 1
            return None
