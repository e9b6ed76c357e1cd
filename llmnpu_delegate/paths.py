"""Where the project keeps data and caches, and how it writes files safely."""
from __future__ import annotations

import hashlib
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


def file_sha256(path: Path) -> str:
    """The file's SHA-256, read in blocks: a program's files are hundreds of MB, never held whole."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


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


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock for ``path`` while the block runs (``flock`` on ``.<name>.lock`` beside
    it): another process, or thread, asking for the same one waits. For work that fills a cache entry
    and is worth doing once: the one that waited then finds the entry made. Where there is no
    ``fcntl`` (Windows) nothing is held, and two writers both finish (``atomic_path``)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.parent / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def source_digest() -> str:
    """A digest of this package's own files (code and data): what a cached result computed by the
    code depends on beyond its inputs. Any change to the package makes new entries."""
    root = Path(__file__).parent
    h = hashlib.sha256()

    def source(path: Path) -> bool:         # not what a build wrote beside the sources
        parts = path.relative_to(root).parts[:-1]
        return path.suffix in (".py", ".json", ".csv") and not any(p.startswith("build") for p in parts)
    for path in sorted(p for p in root.rglob("*") if p.is_file() and source(p)):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def cached_json(kind: str, key: dict, make):
    """``make()``'s JSON result, kept under the cache dir by a digest of ``key`` and of the package's
    source (``source_digest``): computed once per distinct key and code, written atomically; a
    damaged entry is computed again."""
    import json

    digest = hashlib.sha256(json.dumps({"key": key, "source": source_digest()}, sort_keys=True).encode()).hexdigest()
    path = cache_dir() / kind / f"{digest[:24]}.json"
    with exclusive(path):
        try:
            return json.loads(path.read_text())["value"]
        except (OSError, ValueError, KeyError):
            pass
        value = make()
        with atomic_path(path) as tmp:
            tmp.write_text(json.dumps({"key": key, "value": value}))
        return value


class DamagedFile(ValueError):
    """A checked file that is unreadable, truncated, altered, or of another kind."""


_MAGIC = b"llmnpu-checked-1"


def save_checked(obj, path: Path, kind: str) -> None:
    """``torch.save(obj)`` behind a one-line header naming ``kind`` and the SHA-256 of the rest,
    written atomically. torch.load checks no checksum: a flipped byte in a tensor would load."""
    import io

    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    body = buf.getvalue()
    header = b" ".join([_MAGIC, kind.encode(), hashlib.sha256(body).hexdigest().encode()]) + b"\n"
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(header)
            f.write(body)


def load_checked(path: Path, kind: str):
    """What ``save_checked`` wrote (tensors and plain values only); ``DamagedFile`` says what is wrong."""
    import io

    import torch

    data = Path(path).read_bytes()
    header, _, body = data.partition(b"\n")
    parts = header.split(b" ")
    if len(parts) != 3 or parts[0] != _MAGIC:
        raise DamagedFile("not an llmnpu file (no header)")
    if parts[1] != kind.encode():
        raise DamagedFile(f"holds a {parts[1].decode(errors='replace')}, not a {kind}")
    if hashlib.sha256(body).hexdigest().encode() != parts[2]:
        raise DamagedFile("its content does not match its checksum (truncated or altered)")
    try:
        return torch.load(io.BytesIO(body), weights_only=True)
    except Exception as e:  # noqa: BLE001 - a checksummed body that torch cannot read
        raise DamagedFile(f"unreadable ({type(e).__name__})") from None
