"""Independent jobs of a sweep (evaluation modes, export SoCs), run one after another in this process
or, when asked, as Ray tasks on a local Ray instance or an existing cluster.

A job is a module-level function and its arguments, so a Ray worker imports the same code; it
declares what it needs (CPUs, memory) and Ray places it. On Ray a failed job is reported with its
cause and the others run on; in this process a job's error is the command's error, as without Ray.
"""
from __future__ import annotations

import dataclasses
import socket
import time
from collections.abc import Callable
from typing import Any

from .errors import LlmNpuError

LOCAL = "local"           # ``--ray`` without an address: a Ray instance of this machine, for this run
INSTALL_HINT = "pip install 'llmnpu_delegate[ray]'"


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    fn: Callable[..., Any]          # module-level: a Ray worker imports it by name
    args: tuple = ()
    num_cpus: int = 1               # also the job's torch threads, so its numbers are the sequential run's
    memory: int = 0                 # bytes at its peak, for Ray's placement (0: not declared)


@dataclasses.dataclass(frozen=True)
class Failure:
    """A job that raised (or whose worker died): its name and the cause in one line."""
    name: str
    cause: str

    def to_dict(self) -> dict:
        return {"error": self.cause}


@dataclasses.dataclass
class Ran:
    results: dict[str, Any]         # job name -> its result, or a Failure (on Ray)
    seconds: float                  # wall time of the whole sweep
    nodes: dict[str, str]           # job name -> the Ray node that ran it (empty without Ray)

    def report(self, ray: str) -> dict:
        """What a command's JSON says of the sweep's run on Ray."""
        return {"address": ray, "seconds": round(self.seconds, 1), "nodes": self.nodes}


def run_jobs(jobs: list[Job], ray: str | None = None) -> Ran:
    """Run ``jobs``: ``ray`` None here, in order; ``LOCAL`` on a Ray instance started for this call,
    else on the running cluster at that address."""
    names = [j.name for j in jobs]
    if len(set(names)) != len(names):
        raise LlmNpuError(f"two jobs of one sweep share a name: {names}")
    t0 = time.perf_counter()
    if ray is None:
        results, nodes = {j.name: j.fn(*j.args) for j in jobs}, {}
    else:
        results, nodes = _run_on_ray(jobs, ray)
    return Ran(results, time.perf_counter() - t0, nodes)


def require_ray():
    try:
        import ray
    except ImportError:
        raise LlmNpuError(f"--ray needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


def _on_worker(fn: Callable, threads: int, args: tuple):
    import ray
    import torch

    torch.set_num_threads(threads)
    return fn(*args), ray.get_runtime_context().get_node_id()


def _run_on_ray(jobs: list[Job], address: str) -> tuple[dict[str, Any], dict[str, str]]:
    ray = require_ray()
    started = not ray.is_initialized()
    if started:
        check_ray(address)
        try:
            # the package's logs stay on the workers' own files; results come back as values
            ray.init(address=None if address == LOCAL else address, include_dashboard=False,
                     log_to_driver=False, configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = "a local Ray instance" if address == LOCAL else f"the Ray cluster at {address}"
            raise LlmNpuError(f"could not start or reach {where} ({_first_line(e)}): check the address "
                              f"(`ray status --address {address}` on a node), or drop --ray-address for "
                              f"a local instance") from None
    try:
        task = ray.remote(_on_worker)
        pending, results, nodes = {}, {}, {}
        alive = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        for j in jobs:
            unplaceable = _unplaceable(alive, j)
            if unplaceable:         # Ray would hold it pending for ever
                results[j.name] = Failure(j.name, unplaceable)
                continue
            options = {"num_cpus": j.num_cpus, "max_retries": 0}
            if j.memory:
                options["memory"] = j.memory
            pending[task.options(**options).remote(j.fn, j.num_cpus, j.args)] = j.name
        for ref, name in pending.items():
            try:
                results[name], nodes[name] = ray.get(ref)
            except Exception as e:      # the task's own error or its worker's death: reported, the rest kept
                results[name] = Failure(name, _cause(e))
        return {j.name: results[j.name] for j in jobs}, nodes
    finally:
        if started:
            ray.shutdown()


def check_ray(target: str, timeout: float = 5.0) -> None:
    """Ray is installed and, for an address, a cluster's head answers there (host:port); else a
    one-line error now, before any work (Ray itself retries an unreachable address for minutes)."""
    require_ray()
    if target in (LOCAL, "auto"):       # "auto": Ray's own lookup of a cluster started on this machine
        return
    address = target
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        raise LlmNpuError(f"--ray-address wants the head's host:port (as `ray start --head` prints it), got '{address}'")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise LlmNpuError(f"no Ray cluster answers at {address} ({e.strerror or e}): start one (`ray start --head`) "
                          f"or drop --ray-address to use a local Ray instance") from None


def _unplaceable(nodes: list[dict], job: Job) -> str | None:
    """Why none of the live nodes (their resources) can ever run ``job`` (its CPUs or memory), or None."""
    if any(r.get("CPU", 0) >= job.num_cpus and r.get("memory", 0) >= job.memory for r in nodes):
        return None
    biggest = max(nodes, key=lambda r: (r.get("CPU", 0), r.get("memory", 0)), default={})
    return (f"no node of the Ray cluster has {job.num_cpus} CPUs and {job.memory / 2**30:.1f} GiB of memory for it "
            f"(the largest: {biggest.get('CPU', 0):g} CPUs, {biggest.get('memory', 0) / 2**30:.1f} GiB): add such a "
            f"node, or ask for fewer threads (--threads) or workers (--workers)")


def _cause(e: BaseException) -> str:
    """A task's error in one line: the job's own exception where Ray wraps one."""
    inner = getattr(e, "cause", None)
    if isinstance(inner, BaseException):
        e = inner
    return f"{type(e).__name__}: {_first_line(e)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def as_dicts(results: dict[str, Any]) -> dict[str, Any]:
    """``results`` with each Failure as ``{"error": cause}``, the form of a failed row in a command's JSON."""
    return {k: v.to_dict() if isinstance(v, Failure) else v for k, v in results.items()}

