"""Where the project keeps data and caches, and how it writes files safely."""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def cache_dir() -> Path:
    """Root of all caches (models, calibration, shadow weights). Override with LLMNPU_CACHE_DIR."""
    root = Path(os.environ.get("LLMNPU_CACHE_DIR") or Path.home() / ".cache" / "llmnpu_delegate")
    root.mkdir(parents=True, exist_ok=True)
    return root


@contextmanager
def atomic_path(final: Path) -> Iterator[Path]:
    """Yield a temporary path beside ``final``; on success rename it over ``final``.

    Works for a file or a folder. A crash leaves only the temporary name behind, never a
    half-written ``final``; two writers racing both end with a complete ``final``.
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent)) / final.name
    try:
        yield tmp
        try:
            os.replace(tmp, final)
        except OSError:
            # A folder cannot replace a non-empty folder: another writer won the race, and
            # its copy is as good as ours.
            if not (tmp.is_dir() and final.is_dir()):
                raise
    finally:
        shutil.rmtree(tmp.parent, ignore_errors=True)
