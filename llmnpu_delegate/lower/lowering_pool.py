"""Lowering jobs on every core: forked worker processes that share the prepared engine.

Lowering a method is mostly single-threaded Python (export passes, decompositions, the delegate's
preprocess), so an export uses one core of two unless methods are lowered side by side. A lowered
method cannot cross processes (its edge ops do not pickle; ``torch.export.save`` refuses the
delegate call), but its emitted form can (``program_writer.EmittedMethod``: dataclasses and bytes).
So workers are forked after the engine is prepared, read it copy-on-write, and send back emitted
methods. Each worker runs torch on one thread: two workers on two cores, not four threads.
"""
from __future__ import annotations

import ctypes
import gc
import hashlib
import multiprocessing
import multiprocessing.connection
import os
import pickle
import shutil
import tempfile
import traceback
from collections.abc import Callable, Iterable, Iterator

from ..errors import LlmNpuError

JOBS_PER_WORKER = 8


def default_workers() -> int:
    return len(os.sched_getaffinity(0))


class Claims:
    """Keys that one job may claim first, across processes: a claim is a file created with
    ``O_EXCL`` (atomic), so the workers need no shared server process. Use as a context manager."""

    def __enter__(self):
        self.folder = tempfile.mkdtemp(prefix="llmnpu-claims-")
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.folder, ignore_errors=True)

    def first(self, key) -> bool:
        """True for the first caller that claims ``key`` (any picklable value), False for the others."""
        name = hashlib.sha256(repr(key).encode()).hexdigest()
        try:
            os.close(os.open(os.path.join(self.folder, name), os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False


class Spool:
    """Large results kept on disk until they are needed, in a folder under ``where`` (a context
    manager: the folder goes at exit). ``put`` writes an object and returns its file, ``take`` reads
    it back and deletes the file. The export keeps each emitted method here until the program is
    written: gigabytes for a large model, which the parent would otherwise hold (copy-on-write
    shared with no one) beside every worker."""

    def __init__(self, where: str | os.PathLike | None = None):
        self.where = where

    def __enter__(self):
        self.folder = tempfile.mkdtemp(prefix=".llmnpu-spool-", dir=self.where)
        return self

    def __exit__(self, *exc):
        shutil.rmtree(self.folder, ignore_errors=True)

    def put(self, value, name: str) -> str:
        path = os.path.join(self.folder, name)
        _dump(value, path)
        return path

    @staticmethod
    def take(path: str):
        with open(path, "rb") as f:
            value = pickle.load(f)
        os.unlink(path)
        return value


def _dump(value, path: str) -> None:
    """``value`` pickled to ``path``, streamed (no pickled copy in memory), under a temporary name."""
    with open(path + ".tmp", "wb") as f:
        pickle.dump(value, f, protocol=pickle.HIGHEST_PROTOCOL)
    os.rename(path + ".tmp", path)


def run_jobs(fn: Callable, state, jobs: Iterable, workers: int, spool: str | os.PathLike | None = None,
             weight: Callable = lambda job: 1) -> Iterator:
    """``fn(state, job)`` for every job, results as they finish; in this process if ``workers`` is 1.

    The first job is taken to be the longest and runs alone in its process; the others go in batches
    of ``JOBS_PER_WORKER`` (by ``weight``: a job that lowers several methods counts each), each batch
    in a fresh process: what lowering leaves behind in a process
    (the decode step's ~1.5 GiB, native memory of the delegate's compiler) goes with it. A worker
    that dies (the out-of-memory killer) or fails stops the export with an error, never a wait.

    Results come back as files in a folder under ``spool`` (default: the temporary folder), one per
    job, written to a temporary name and renamed: a worker streams its result to disk instead of
    holding a pickled copy of it (gigabytes for a large model's decode step), and one killed while
    writing leaves no half message for the parent to wait on (a pipe's would)."""
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(state, job)
        return
    # what the workers read stays shared: the collector does not touch (and so copy) the objects the
    # parent made, and memory the parent freed goes back to the system instead of being inherited
    gc.collect()
    gc.freeze()
    _trim_heap()
    ctx = multiprocessing.get_context("fork")
    folder = tempfile.mkdtemp(prefix=".llmnpu-results-", dir=spool)
    pending, live, done = list(reversed(list(enumerate(jobs)))), [], 0
    try:
        while done < len(jobs):
            ready = sorted(f for f in os.listdir(folder) if f.endswith(".pkl"))
            if not ready:
                _reap(live)
                while len(live) < workers and pending:
                    batch = [pending.pop()]
                    while (done or live) and pending and sum(weight(j) for _, j in batch) + weight(pending[-1][1]) \
                            <= JOBS_PER_WORKER:
                        batch.append(pending.pop())
                    worker = ctx.Process(target=_work, args=(fn, state, batch, folder), daemon=True)
                    worker.start()
                    live.append(worker)
                if not live:
                    raise LlmNpuError(f"the lowering workers ended with {len(jobs) - done} of {len(jobs)} jobs "
                                      f"unanswered")
                multiprocessing.connection.wait([w.sentinel for w in live], timeout=0.2)
                continue
            for name in ready:
                ok, value = Spool.take(os.path.join(folder, name))
                if not ok:
                    raise value
                done += 1
                yield value
    finally:
        for worker in live:
            if worker.is_alive():
                worker.kill()
            worker.join()
        shutil.rmtree(folder, ignore_errors=True)
        gc.unfreeze()


def _reap(live: list) -> None:
    """Drop the workers that have finished their batch; raise if one died or failed to exit cleanly."""
    for worker in list(live):
        if worker.exitcode is None:
            continue
        live.remove(worker)
        if worker.exitcode != 0:
            why = (f"was killed by signal {-worker.exitcode} (out of memory?)" if worker.exitcode < 0
                   else f"exited with code {worker.exitcode}")
            raise LlmNpuError(f"a lowering worker {why}: export again with fewer --workers (1 lowers in this "
                              f"process) or on a machine with more memory")


def _work(fn: Callable, state, batch: list, folder: str) -> None:
    import torch
    torch.set_num_threads(1)
    for seq, job in batch:
        try:
            result = (True, fn(state, job))
        except BaseException as e:          # the parent raises it; a traceback in text if it won't pickle
            try:
                pickle.dumps(e)
            except Exception:
                e = RuntimeError(f"lowering job {job!r} failed in a worker:\n{traceback.format_exc()}")
            result = (False, e)
        _dump(result, os.path.join(folder, f"{seq:08d}.pkl"))
        if not result[0]:
            return
        del result


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):        # not glibc: nothing to trim this way
        pass
