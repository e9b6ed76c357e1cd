"""Atomic writes: a crash leaves no half-written file; racing writers both end with a valid one."""
import threading

import pytest

from llmnpu_delegate.paths import atomic_path


def test_atomic_file_and_crash(tmp_path):
    target = tmp_path / "a" / "f.bin"
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"ok")
    assert target.read_bytes() == b"ok"
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("crash")
    assert target.read_bytes() == b"ok"
    assert sorted(p.name for p in target.parent.iterdir()) == ["f.bin"]  # no temporary left


def test_racing_folder_writers(tmp_path):
    target = tmp_path / "model"
    barrier = threading.Barrier(4)
    errors = []

    def write(i):
        try:
            with atomic_path(target) as tmp:
                tmp.mkdir()
                barrier.wait()
                (tmp / "weights").write_text(f"writer {i}")
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=write, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert (target / "weights").read_text().startswith("writer ")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]
