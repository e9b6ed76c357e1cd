"""Two workers, ``npu`` and ``cpu``, each running one task at a time on its own thread, handed their
next task by a scheduling policy.

Values live in one environment per chunk and are dropped as soon as their last consumer has run.
A task that raises stops both workers; the caller gets a ``TaskError`` naming the task.

A run owns the machine: it sets torch's thread count and pauses the cyclic GC, both process-wide,
and its two workers take every core. Runs are therefore serialized process-wide (``_RUN_LOCK``):
callers on several threads, of one engine or of several, wait their turn and never see each
other's settings.

The worker threads live as long as the process (one per processor and core set, idle between
runs): a thread keeps what it built on its first run, oneDNN's JIT kernels for the attention
shapes and its malloc arena, and a run does not pay for starting threads (~1-3 ms a run when
they were made per run).
"""
from __future__ import annotations

import ctypes
import gc
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..format.tasks import Task, build_tasks, past_name
from ..kernels import int8_path, native_ops
from .program import ChunkProgram
from .schedule import (
    COST_POLICIES, POLICIES, PROCESSORS, Record, RunStats, Scheduler, assign_costs, cannot_finish, check_policy,
)

_RUN_LOCK = threading.Lock()
SPIN_S = 2e-3      # how long an idle worker spins for the next hand-off before it blocks (see _Wakeup)
HELP_S = 1.0       # ... and a worker that helps the other's kernels meanwhile (Workers.help)


class TaskError(LlmNpuError):
    """A subgraph failed during prefill; ``task`` says which."""

    def __init__(self, message: str, task: Task):
        super().__init__(message)
        self.task = task


@dataclass(frozen=True)
class Workers:
    """Threads per worker and optional core pinning; the two must not oversubscribe the machine.

    The stand-in NPU is a CPU core too, so an idle worker can lend itself to the other lane (a
    phone's NPU is its own hardware, and ``llmnpu simulate`` models that), in two ways:

    - ``steal``: a worker with no ready task of its own runs the other lane's next task, whole
      (``schedule.Scheduler``). The lanes' work then splits evenly over the cores however the
      placement divides it.
    - ``help``: a worker with nothing to run at all (no task of either lane ready) runs pieces of
      the other's running task: the CPU worker pieces of the NPU task's native INT8 kernels, the NPU
      worker pieces of the CPU's bf16 attention (``kernels/native/lane_help.h``).

    Both off with ``LLMNPU_LANE_HELP=0``."""
    threads: int = 1
    cores: dict | None = None   # processor -> set of CPU ids, or None: no pinning
    help: bool = True
    steal: bool = True

    @classmethod
    def auto(cls) -> "Workers":
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 2))
        lend = os.environ.get("LLMNPU_LANE_HELP", "1") != "0"
        if len(cpus) < 2:      # one core: a helper's spin would take it from the NPU worker
            return cls(1, None, False, False)
        half = len(cpus) // 2
        return cls(half, {"npu": set(cpus[:half]), "cpu": set(cpus[half:2 * half])}, lend, lend)


_POOL: dict[tuple, queue.SimpleQueue] = {}     # (processor, cores) -> its worker's job queue
if hasattr(os, "register_at_fork"):             # a forked child has none of the parent's threads
    os.register_at_fork(after_in_child=_POOL.clear)


def _serve(jobs: queue.SimpleQueue, cores: set | None) -> None:
    if cores and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cores)        # this thread only (Linux)
    while True:
        job, done = jobs.get()
        try:
            job()
        finally:
            # the thread outlives the run: its last job would keep that prefill (its chunks' values,
            # its engine's compiled steps) alive until the next one
            job = None
            done.set()


def _submit(processor: str, cores: set | None, job) -> threading.Event:
    """Run ``job()`` on the long-lived worker thread of ``processor`` (made on first use; call under
    ``_RUN_LOCK``). Returns an event set when the job has returned or raised."""
    key = (processor, frozenset(cores) if cores else None)
    if key not in _POOL:
        _POOL[key] = queue.SimpleQueue()
        threading.Thread(target=_serve, args=(_POOL[key], cores), name=f"llmnpu-{processor}", daemon=True).start()
    done = threading.Event()
    _POOL[key].put((job, done))
    return done


class _Wakeup:
    """The workers' condition, with a generation counter bumped by every notify. An idle worker first
    spins on the counter with the GIL released (``native_ops.spin_wait``, up to ``SPIN_S``), then
    blocks on the condition. A blocked worker's core goes to sleep: waking one of two pinned threads
    takes 20-50 us on this VM (an Event ping-pong), a spinning one sees the change at once. Eight
    alternating runs on the embedded model: wall 288 -> 281 ms (medians). Use under ``with wakeup.cond``."""

    def __init__(self):
        self.cond = threading.Condition()
        self.generation = ctypes.c_int64(0)
        self.spin = native_ops.spin_wait()
        self.spun = self.blocked = 0      # waits that ended while spinning / that blocked

    def notify(self) -> None:
        self.generation.value += 1
        self.cond.notify_all()

    def wait(self, help: bool = False) -> None:
        """``help``: spin up to ``HELP_S`` and run shared pieces of the native kernels meanwhile."""
        seen = self.generation.value
        if self.spin is not None:
            self.cond.release()       # held once, by the caller's ``with``
            try:
                self.spin(ctypes.byref(self.generation), seen, int((HELP_S if help else SPIN_S) * 1e9), int(help))
            finally:
                self.cond.acquire()
            if self.generation.value != seen:
                self.spun += 1
                return
        self.blocked += 1
        self.cond.wait()     # every notify happens under the lock: none is missed between the two


class _Shape:
    """One prompt shape of a program: its task graph, how often each chunk reads each value (values
    are dropped after their last read), and a scheduler per policy and costs."""

    def __init__(self, program: ChunkProgram, chunks: int):
        self.tasks = build_tasks(program, chunks)
        self.uses: list[dict[str, int]] = [dict() for _ in range(chunks)]
        for t in self.tasks:
            for name in program.steps[t.step].sub.inputs:
                self.uses[t.chunk][name] = self.uses[t.chunk].get(name, 0) + 1
        self._schedulers: dict[tuple, Scheduler] = {}

    def scheduler(self, policy: str, costs: dict | None, steal: bool) -> Scheduler:
        assign_costs(self.tasks, costs)
        key = (policy, steal, tuple(t.cost for t in self.tasks) if policy in COST_POLICIES else None)
        sched = self._schedulers.get(key)
        if sched is None:
            if len(self._schedulers) >= 2 * len(POLICIES):     # costs changed (a new profile): start over
                self._schedulers.clear()
            sched = self._schedulers[key] = Scheduler(self.tasks, policy, steal)
        else:
            sched.reset()
        return sched


class Executor:
    """Runs a ChunkProgram over the chunks of a prompt with two workers and a policy. ``tail``: a
    program of the same subgraphs for fewer rows (``ChunkProgram.tail``), run for a chunk fed that
    many rows; its tasks are the same, so one task graph serves both."""

    SHAPES = 8      # prompt shapes (chunk counts) whose task graph and schedulers are kept

    def __init__(self, program: ChunkProgram, workers: Workers | None = None, tail: ChunkProgram | None = None):
        self.program = program
        self.programs = {p.chunk_len: p for p in (program, tail) if p is not None}    # by rows
        self.workers = workers or Workers.auto()
        self.keep = {program.out_logits, *program.out_k, *program.out_v}
        handoff = {k: past_name("k", i) for i, k in enumerate(program.out_k)}
        handoff.update({v: past_name("v", i) for i, v in enumerate(program.out_v)})
        self.inputs = [s.sub.inputs for s in program.steps]
        self.outputs = [s.sub.outputs for s in program.steps]
        self.handoffs = [[(i, handoff[name]) for i, name in enumerate(s.sub.outputs) if name in handoff]
                         for s in program.steps]
        self._shapes: OrderedDict[int, _Shape] = OrderedDict()

    def _shape(self, chunks: int) -> "_Shape":
        """The task graph of a ``chunks``-chunk prompt and its schedulers, built on first use (~3 ms
        with the scheduler) and kept for the last ``SHAPES`` chunk counts."""
        shape = self._shapes.pop(chunks, None) or _Shape(self.program, chunks)
        self._shapes[chunks] = shape
        while len(self._shapes) > self.SHAPES:
            self._shapes.popitem(last=False)
        return shape

    def run(self, feeds: list[dict[str, Tensor]], policy: str, costs: dict | None = None,
            fail: tuple[int, int] | None = None) -> tuple[dict[str, Tensor], RunStats]:
        """``feeds[i]``: chunk i's inputs except the past K/V. Returns the last chunk's outputs.
        ``fail=(chunk, step)`` injects a failure (for tests of the error path). The run's wall time
        counts from here: the task graph and the scheduler are part of what a prompt waits for."""
        check_policy(policy)
        rows = {f["input_ids"].shape[-1] for f in feeds}
        if not rows <= self.programs.keys():
            raise LlmNpuError(f"chunks of {sorted(rows - self.programs.keys())} rows have no program here "
                              f"(programs for {sorted(self.programs)} rows)")
        with _RUN_LOCK:
            t0 = time.perf_counter()
            shape = self._shape(len(feeds))
            return self._run(feeds, shape.scheduler(policy, costs, self.workers.steal), shape.uses, fail, t0)

    def _run(self, feeds, sched: Scheduler, uses: list[dict[str, int]], fail, t0: float):
        run = _Run(self, feeds, sched, uses, fail, t0)
        lent0 = native_ops.pieces_helped()
        saved = torch.get_num_threads()
        torch.set_num_threads(self.workers.threads)
        gc_was_on = gc.isenabled()
        gc.disable()     # a cyclic-GC pass in the middle of a task is a bubble (seen: 80 ms)
        try:
            cores = self.workers.cores or {}
            for done in [_submit(p, cores.get(p), lambda p=p: run.worker(p)) for p in PROCESSORS]:
                done.wait()
        finally:
            torch.set_num_threads(saved)
            if gc_was_on:
                gc.enable()
        stats = run.stats
        stats.wall_s = time.perf_counter() - t0
        stats.records = sorted((Record(*r) for rs in run.raw.values() for r in rs), key=lambda r: r.start)
        stats.waits_spun, stats.waits_blocked = run.wakeup.spun, run.wakeup.blocked
        stats.pieces_lent = native_ops.pieces_helped() - lent0
        stats.stolen = sum(r.processor != sched.tasks[r.task].processor for r in stats.records)
        if run.error:
            self._raise(*run.error[0])
        last = run.envs[-1]
        return {k: last[k] for k in self.keep if k in last}, stats

    def _raise(self, task: Task | None, exc: BaseException):
        if task is None:
            raise exc
        sub = self.program.steps[task.step].sub
        where = f"layer {sub.layer}" if sub.layer is not None else "model"
        raise TaskError(f"prefill task failed: chunk {task.chunk}, subgraph {task.step} "
                        f"({sub.kind} on {task.processor}, {where}): {exc}", task) from exc


def _direct(fn):
    """A step's module called at its ``forward``: nn.Module's call machinery (hooks, which no step
    has) costs ~2 us a task, with the GIL held."""
    return fn.forward if isinstance(fn, torch.nn.Module) else fn


class _Run:
    """One prefill in flight: the chunks' environments, what is left to read in them, and the two
    workers' loop. All shared state changes under ``wakeup.cond``; a task itself runs outside it."""

    def __init__(self, ex: Executor, feeds, sched: Scheduler, uses: list[dict[str, int]], fail, t0: float):
        self.ex, self.sched, self.fail, self.t0 = ex, sched, fail, t0
        fns = {rows: [_direct(s.fn) for s in p.steps] for rows, p in ex.programs.items()}
        self.fns = [fns[f["input_ids"].shape[-1]] for f in feeds]     # per chunk: its program's steps
        self.envs = [dict(f) for f in feeds]
        self.uses = [dict(u) for u in uses]
        self.stats = RunStats(policy=sched.policy)
        self.raw: dict[str, list[tuple]] = {p: [] for p in PROCESSORS}   # per worker: Record fields
        self.wakeup = _Wakeup()
        self.error: list[tuple[Task | None, BaseException]] = []
        # Which worker helps the other's kernels while it waits (``Workers.help``): the CPU worker, when
        # the NPU's INT8 linears are the native kernels (oneDNN's are one call each); the NPU worker,
        # when attention is the native bf16 kernel. With other kernels there are no pieces to take,
        # and a helper would spin where its core could sleep.
        native = ex.workers.help and native_ops.native_available()
        self.lends = {"cpu": native and int8_path.current() in int8_path.NATIVE_PATHS,
                      "npu": native and ex.program.attention == "bf16"}
        # torch.profiler is on (the module flag: _profiler_enabled() is per thread, and False
        # with profile_all_threads, which is what sees the workers' ops)
        self.profiling = getattr(torch.autograd.profiler, "_is_profiler_enabled", False)

    def worker(self, processor: str) -> None:
        try:
            torch.set_num_threads(self.ex.workers.threads)   # a thread keeps the count it first saw
            with torch.inference_mode():                     # grad mode is per thread
                self.work(processor)
        except BaseException as e:  # noqa: BLE001 - a scheduler bug must reach the caller, not kill the worker
            self._fail(None, e)

    def _fail(self, task: Task | None, e: BaseException) -> None:
        with self.wakeup.cond:
            self.error.append((task, e))
            self.wakeup.notify()

    def work(self, processor: str) -> None:
        records, cond = self.raw[processor], self.wakeup.cond
        lend = self.lends[processor]
        task = outs = None
        start = end = 0.0
        while True:
            with cond:     # one lock per task: hand over the last task's outputs, then pick the next
                if task is not None:
                    records.append((task.id, task.chunk, task.step, processor, start - self.t0, end - self.t0))
                    self._hand_over(task, outs)
                task = self._next(processor, lend)
                if task is None:
                    return
                args = self._args(task)
                if args is None:
                    return
            start = time.perf_counter()
            try:
                outs = self._call(task, args)
            except BaseException as e:  # noqa: BLE001 - every failure must reach the caller
                self._fail(task, e)
                return
            end = time.perf_counter()

    def _hand_over(self, task: Task, outs) -> None:
        """Publish a finished task's outputs (and the next chunk's past K/V), drop the values no one
        will read again, and tell the scheduler."""
        ex, env, left = self.ex, self.envs[task.chunk], self.uses[task.chunk]
        last = task.chunk + 1 == len(self.envs)
        # an earlier chunk's K/V live on as the next chunk's past only: holding every chunk's (each
        # longer than the last) would keep the prompt's K/V several times over
        env.update((name, out) for name, out in zip(ex.outputs[task.step], outs)
                   if left.get(name) or (last and name in ex.keep))
        if not last:
            nxt = self.envs[task.chunk + 1]
            for i, past in ex.handoffs[task.step]:
                nxt[past] = outs[i]
        for name in ex.inputs[task.step]:
            left[name] -= 1
            if left[name] == 0 and not (last and name in ex.keep):
                env.pop(name, None)
        self.sched.finish(task)
        self.wakeup.notify()

    def _next(self, processor: str, lend: bool) -> Task | None:
        """The processor's next task, waiting while none is ready; None when the run is over."""
        sched, stats, wakeup = self.sched, self.stats, self.wakeup
        while True:
            if self.error or sched.finished:
                wakeup.notify()
                return None
            d0 = time.perf_counter()
            task = sched.pick(processor)
            stats.decision_s += time.perf_counter() - d0
            stats.decisions += 1
            if task is not None:
                return task
            if sched.stuck():
                self.error.append((None, cannot_finish(sched.policy)))
                wakeup.notify()
                return None
            # nothing ready here: the NPU worker runs a task or is about to pick one
            wakeup.wait(help=lend)

    def _args(self, task: Task) -> list | None:
        env = self.envs[task.chunk]
        try:
            return [env[name] for name in self.ex.inputs[task.step]]
        except KeyError as e:   # a task graph that lets a task run before its producer: report, never hang
            self.error.append((task, LlmNpuError(f"input {e.args[0]} was not made before this task")))
            self.wakeup.notify()
            return None

    def _call(self, task: Task, args: list):
        if self.fail == task.key:
            raise RuntimeError("injected failure")
        if self.profiling:   # torch.profiler sees each task as a region named after it
            with torch.profiler.record_function(f"llmnpu.{task.processor}[{task.chunk}:{task.step}]"):
                return self.fns[task.chunk][task.step](*args)
        return self.fns[task.chunk][task.step](*args)
