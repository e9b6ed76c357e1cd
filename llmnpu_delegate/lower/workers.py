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
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator

_STATE = None      # what the jobs read; set in the parent just before the workers fork
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


def run_jobs(fn: Callable, state, jobs: Iterable, workers: int) -> Iterator:
    """``fn(state, job)`` for every job, results as they finish; in this process if ``workers`` is 1."""
    global _STATE
    jobs = list(jobs)
    if workers <= 1 or len(jobs) <= 1:
        for job in jobs:
            yield fn(state, job)
        return
    _STATE = state
    # what the workers read stays shared: the collector does not touch (and so copy) the objects the
    # parent made, and memory the parent freed goes back to the system instead of being inherited
    gc.collect()
    gc.freeze()
    _trim_heap()
    # a worker is replaced after a few jobs: what lowering leaves behind in a process (the decode
    # step's ~1.5 GiB, native memory of the delegate's compiler) goes with it
    pool = multiprocessing.get_context("fork").Pool(min(workers, len(jobs)), initializer=_one_thread,
                                                    maxtasksperchild=JOBS_PER_WORKER)
    try:
        yield from pool.imap_unordered(_Call(fn), jobs, chunksize=1)
        pool.close()
    finally:
        pool.terminate()
        gc.unfreeze()
        _STATE = None


def _trim_heap() -> None:
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):        # not glibc: nothing to trim this way
        pass


def _one_thread() -> None:
    import torch
    torch.set_num_threads(1)


class _Call:
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, job):
        return self.fn(_STATE, job)
