"""The scheduling policies: which ready (chunk, subgraph) task a processor runs next.

One class per policy behind one interface (``Policy``), shared by the threaded executor
(``executor.py``), the simulated time of ``simulate()`` (the phone model and ``llmnpu simulate``) and
mirrored, decision for decision, by the native runner's ``runner/src/schedule.cpp``.

- ``inorder``: chunk after chunk, subgraph after subgraph; one task at a time in all.
- ``overlap``: each processor takes its own tasks in program order; the two processors overlap,
  but nothing is reordered.
- ``ooo``: the paper's heuristic (section 3.4). Among the ready tasks of a processor, a CPU task
  scores the total profiled NPU time of the tasks it makes ready, an NPU task scores minus its own
  time; the highest score runs. The NPU is the critical path: feed it first. The paper leaves ties
  open, and they are common (the same subgraph of two chunks scores alike): the task with the
  longer chain of profiled work after it wins, then the earlier chunk.
- ``cp``: list scheduling by critical path (HEFT's upward rank): among the ready tasks of a
  processor, the one with the longest chain of profiled work from its start to the end of the
  prompt runs first. Needs the profile, like ``ooo``.

Stealing (``steal=True``), under any policy: a processor with no task of its own that the policy
lets start takes the task the policy would start next on the other processor. That is only right
where both lanes are cores of one CPU and a subgraph may run on either (the engine on the host); a
phone's NPU runs no float task, so the phone model never steals, and the ``.pte`` runners give each
lane's methods one shared arena, so they do not either. A stolen task keeps its cost: two cores
alike. A task never starts while another of its subgraph runs (two chunks' tasks, one on each
worker): a subgraph's function is not assumed reentrant. Without stealing each subgraph has one
worker, so that holds by itself.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import LlmNpuError
from ..format.tasks import Task

PROCESSORS = ("npu", "cpu")
OTHER = {"npu": "cpu", "cpu": "npu"}


class Policy:
    """Picks among a ``Scheduler``'s ready tasks. ``uses_costs``: it reads the profiled task costs
    (a runner without a profile runs such a policy in order first, to make one)."""
    name = ""
    uses_costs = False

    def __init__(self, sched: "Scheduler"):
        self.sched = sched

    def reset(self) -> None:
        """Back to the start of a run."""

    def pick(self, processor: str, ready: set) -> int | None:
        raise NotImplementedError

    def stuck(self) -> bool:
        """Nothing runs and this policy lets no processor start anything."""
        return not any(self.sched.ready.values())


class InOrder(Policy):
    name = "inorder"

    def reset(self) -> None:
        self.cursor = 0

    def pick(self, processor, ready):
        order = self.sched.order
        if self.sched.running or self.cursor >= len(order) or order[self.cursor] not in ready:
            return None
        self.cursor += 1
        return order[self.cursor - 1]

    def stuck(self) -> bool:
        s = self.sched
        nxt = s.order[self.cursor]
        return nxt not in s.ready[s.tasks[nxt].processor]


class Overlap(Policy):
    name = "overlap"

    def __init__(self, sched):
        super().__init__(sched)
        self.queues = {p: [i for i in sched.order if sched.tasks[i].processor == p] for p in PROCESSORS}

    def reset(self) -> None:
        self.heads = {p: 0 for p in PROCESSORS}

    def _head(self, processor: str) -> int | None:
        queue, head = self.queues[processor], self.heads[processor]
        return queue[head] if head < len(queue) else None

    def pick(self, processor, ready):
        head = self._head(processor)
        if head is None or head not in ready:
            return None
        self.heads[processor] += 1
        return head

    def stuck(self) -> bool:
        return not any(self._head(p) is not None and self._head(p) in self.sched.ready[p] for p in PROCESSORS)


class CriticalPath(Policy):
    """Ranks are built once per task graph and costs: a decision sits between two NPU tasks."""
    name = "cp"
    uses_costs = True

    def __init__(self, sched):
        super().__init__(sched)
        tasks = sched.tasks
        rank = [0.0] * len(tasks)
        for t in reversed(tasks):     # tasks come in a topological order: users after their deps
            rank[t.id] = t.cost + max((rank[u] for u in t.users), default=0.0)
        self.ties = [(rank[t.id], -t.chunk, -t.step) for t in tasks]

    def pick(self, processor, ready):
        return max(ready, key=self.ties.__getitem__)


class OutOfOrder(CriticalPath):
    name = "ooo"

    def __init__(self, sched):
        super().__init__(sched)
        tasks = sched.tasks
        self.npu_users = [[(u, tasks[u].cost) for u in t.users if tasks[u].processor == "npu"] for t in tasks]
        # an NPU task's score is its own cost: fixed, so its whole key is built here
        self.npu_keys = [(-t.cost, *self.ties[t.id]) for t in tasks]

    def pick(self, processor, ready):
        if processor == "npu":
            return max(ready, key=self.npu_keys.__getitem__)
        return max(ready, key=self._score)

    def _score(self, i: int) -> tuple:
        """A CPU task's key: the NPU work it makes ready (its NPU users that wait for it alone)."""
        missing = self.sched.missing
        return (sum(cost for u, cost in self.npu_users[i] if missing[u] == 1), *self.ties[i])


POLICY_CLASSES = {c.name: c for c in (InOrder, Overlap, OutOfOrder, CriticalPath)}
POLICIES = tuple(POLICY_CLASSES)
COST_POLICIES = tuple(n for n, c in POLICY_CLASSES.items() if c.uses_costs)


def check_policy(policy: str) -> str:
    """``policy`` if it is one of ``POLICIES``, else an LlmNpuError naming them."""
    if policy not in POLICY_CLASSES:
        raise LlmNpuError(f"unknown policy '{policy}': use one of {', '.join(POLICIES)}")
    return policy


def cannot_finish(policy: str) -> LlmNpuError:
    return LlmNpuError(f"the {policy} schedule cannot finish: tasks wait for one that never runs (a broken task graph)")


class Scheduler:
    """A policy over one task graph with fixed costs: the ready sets and what each task still waits
    for. What depends on the graph and the costs alone is computed here, once (~1 ms for 1,100
    tasks); ``reset`` starts a run, so a runner keeps a scheduler per prompt shape and pays only the reset."""

    def __init__(self, tasks: list[Task], policy: str, steal: bool = False):
        self.tasks, self.policy, self.steal = tasks, check_policy(policy), steal
        self.order = sorted(range(len(tasks)), key=lambda i: tasks[i].key)     # program order
        self._missing = [len(t.deps) for t in tasks]
        self._sources = {p: {t.id for t in tasks if not t.deps and t.processor == p} for p in PROCESSORS}
        self.rule = POLICY_CLASSES[policy](self)
        self.reset()

    def reset(self) -> None:
        """Back to the start of a run: nothing finished, the tasks without dependencies ready."""
        self.missing = list(self._missing)
        self.left = len(self.tasks)      # tasks not finished
        self.running = 0
        self.busy_steps: set[int] = set()    # stealing: the subgraphs running now
        self.ready = {p: set(ids) for p, ids in self._sources.items()}
        self.rule.reset()

    def pick(self, processor: str) -> Task | None:
        """The task ``processor`` runs next: its own, else (stealing) the other processor's."""
        for p in (processor, OTHER[processor]) if self.steal else (processor,):
            ready = self.ready[p]
            if self.busy_steps:     # only while stealing: a subgraph runs one call at a time
                ready = {i for i in ready if self.tasks[i].step not in self.busy_steps}
            choice = self.rule.pick(p, ready) if ready else None
            if choice is not None:
                self.ready[p].discard(choice)
                self.running += 1
                if self.steal:
                    self.busy_steps.add(self.tasks[choice].step)
                return self.tasks[choice]
        return None

    def finish(self, t: Task) -> None:
        self.left -= 1
        self.running -= 1
        self.busy_steps.discard(t.step)
        for u in t.users:
            self.missing[u] -= 1
            if self.missing[u] == 0:
                self.ready[self.tasks[u].processor].add(u)

    @property
    def finished(self) -> bool:
        return self.left == 0

    def stuck(self) -> bool:
        """Nothing runs and no processor may start anything: the remaining tasks wait forever."""
        if self.running or self.finished:
            return False
        return self.rule.stuck()


@dataclass
class Record:
    task: int
    chunk: int
    step: int
    processor: str
    start: float
    end: float


@dataclass
class RunStats:
    records: list[Record] = field(default_factory=list)
    decisions: int = 0
    decision_s: float = 0.0     # time spent choosing tasks (under the scheduler lock)
    waits_spun: int = 0         # an idle worker's waits for a hand-off that spinning caught
    waits_blocked: int = 0      # ... and those that slept on the condition
    pieces_lent: int = 0        # pieces of one lane's kernels the other, waiting, ran (Workers.help)
    stolen: int = 0             # tasks the other lane's worker ran (stealing)
    wall_s: float = 0.0
    policy: str = ""


def assign_costs(tasks: list[Task], costs: dict | None) -> None:
    """Each task's profiled cost from ``Profile.costs``: per (step, chunk) for dynamic steps, per step else."""
    for t in tasks:
        t.cost = costs.get((t.step, t.chunk), costs.get(t.step, 0.0)) if costs else 0.0


def simulate(tasks: list[Task], policy: str, steal: bool = False) -> RunStats:
    """The policy driven by simulated time instead of threads: each task takes its ``cost``. When a
    processor is idle it asks the scheduler (npu first); the earliest finish (npu first on a tie)
    is handled next. Deterministic, so another implementation of the policies (the native runner's
    ``--dry-run``) must decide exactly alike. A record's ``processor`` is where the task ran."""
    sched = Scheduler(tasks, policy, steal)
    stats = RunStats(policy=policy)
    busy: dict[str, tuple[float, Task, float] | None] = {p: None for p in PROCESSORS}
    now = 0.0
    while not sched.finished:
        for p in PROCESSORS:
            if busy[p] is None:
                stats.decisions += 1
                t = sched.pick(p)
                if t is not None:
                    busy[p] = (now + t.cost, t, now)
        running = [p for p in PROCESSORS if busy[p] is not None]
        if not running:   # sched.stuck(): nothing runs, nothing may start
            raise cannot_finish(policy)
        p = min(running, key=lambda q: busy[q][0])
        now, t, start = busy[p]
        busy[p] = None
        sched.finish(t)
        stats.records.append(Record(t.id, t.chunk, t.step, p, start, now))
        stats.stolen += p != t.processor
    stats.wall_s = now
    return stats
