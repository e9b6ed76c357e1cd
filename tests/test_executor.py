"""The out-of-order executor: same outputs under every policy, dependencies respected, failures
reported with the task's name, no threads left behind."""
import copy
import os
import statistics
import threading

import pytest
import torch
from conftest import missing, on_int64, outlier_model
from hypothesis import HealthCheck, given, settings, strategies as st

from llmnpu_delegate.backends.graph_cache import GraphCache
from llmnpu_delegate.format.tasks import build_tasks
from llmnpu_delegate.models import load_model
from llmnpu_delegate.quantize import CalibConfig, QuantConfig, calibrate
from llmnpu_delegate.runtime.engine import Prefiller
from llmnpu_delegate.runtime.executor import TaskError, Workers
from llmnpu_delegate.runtime.program import ChunkProgram, Step, program_digest
from llmnpu_delegate.runtime.schedule import POLICIES, Scheduler


@pytest.fixture(scope="module")
def calibrated():
    lm = outlier_model()
    ids = torch.randint(0, 1000, (4 * 64,), generator=torch.Generator().manual_seed(2))
    calib = calibrate(lm.model, ids, lm.fingerprint, CalibConfig(samples=4, tokens=64, probe_tokens=64), progress=False)
    return lm, calib


@pytest.fixture(scope="module")
def engine(calibrated, tmp_path_factory):
    lm, calib = calibrated
    return Prefiller(lm, 8, quant=QuantConfig(pruning_rate=0.5), calibration=calib,
                     cache=GraphCache(tmp_path_factory.mktemp("graphs")), progress=False)


def test_out_of_order_int8_equals_in_order_int64_arithmetic(engine, calibrated):
    """The executor's two workers on this CPU's INT8 kernel against an in-order run of the same program
    whose INT8 linears are int64 arithmetic (no shared kernel)."""
    lm, calib = calibrated
    reference = on_int64(Prefiller, lm, 8, quant=QuantConfig(pruning_rate=0.5), calibration=calib,
                         cache=GraphCache(), progress=False)
    ids = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(5))
    want = on_int64(reference, ids, policy="inorder").logits
    got = engine(ids, policy="ooo").logits
    with torch.no_grad():
        effect = float((want - lm.model(ids[None]).logits[0, -1]).abs().max())
    assert effect > 1e-3 and float((got - want).abs().max()) <= effect / 1000


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(length=st.integers(1, 60))
def test_policies_give_bit_identical_outputs(engine, length):
    ids = torch.randint(0, 1000, (length,), generator=torch.Generator().manual_seed(length))
    results = {p: engine(ids, policy=p) for p in POLICIES}
    base = results["inorder"]
    for p in POLICIES:
        assert torch.equal(results[p].logits, base.logits), p
        assert all(torch.equal(a, b) for a, b in zip(results[p].past_k, base.past_k)), p
        assert all(torch.equal(a, b) for a, b in zip(results[p].past_v, base.past_v)), p


def test_every_task_starts_after_its_dependencies(engine):
    ids = torch.randint(0, 1000, (45,))
    engine(ids)                                    # profiles if needed
    engine(ids, policy="ooo")
    stats = engine.last_run
    tasks = build_tasks(engine.program, 6)
    end = {r.task: r.end for r in stats.records}
    start = {r.task: r.start for r in stats.records}
    assert len(stats.records) == len(tasks)
    for t in tasks:
        assert all(end[d] <= start[t.id] for d in t.deps), t
    # one task at a time per processor
    for proc in ("npu", "cpu"):
        spans = sorted((r.start, r.end) for r in stats.records if r.processor == proc)
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), proc
    assert stats.decisions > 0


def test_cross_chunk_dependencies_are_per_layer(engine):
    tasks = build_tasks(engine.program, 3)
    steps = engine.program.steps
    for t in tasks:
        for d in t.deps:
            dep = tasks[d]
            if dep.chunk != t.chunk:
                assert dep.chunk == t.chunk - 1
                assert steps[dep.step].sub.layer == steps[t.step].sub.layer
                assert not steps[t.step].static


def test_inorder_never_overlaps_and_overlap_keeps_program_order(engine):
    ids = torch.randint(0, 1000, (40,))
    engine(ids, policy="inorder")
    spans = sorted((r.start, r.end) for r in engine.last_run.records)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    engine(ids, policy="overlap")
    # by each task's own lane: a worker that steals runs the other lane's tasks, each the one that
    # lane takes next, so a worker's own sequence mixes two program orders
    lane = {i: s.sub.processor for i, s in enumerate(engine.program.steps)}
    for proc in ("npu", "cpu"):
        order = [(r.chunk, r.step) for r in sorted(engine.last_run.records, key=lambda r: r.start) if lane[r.step] == proc]
        assert order and order == sorted(order)


def test_ooo_reorders_and_cuts_bubbles_when_the_profile_says_so(engine, monkeypatch):
    """Each task is made to take a set time (a sleep before the real work: the two workers then run
    truly in parallel) with slow attention on the CPU, the paper's case. Out of order must run some
    processor's tasks out of program order, start a later chunk's NPU work before an earlier chunk's
    CPU work ends, and leave fewer NPU bubbles than in order: from the recorded task times. The
    paper's two lanes: neither steals the other's tasks."""
    import dataclasses

    from llmnpu_delegate.runtime.trace import metrics

    monkeypatch.setattr(engine.executor, "workers", dataclasses.replace(engine.executor.workers, steal=False))
    cost = _slow_attention(engine, monkeypatch)
    feeds = engine.feeds(torch.randint(0, 1000, (24,)))     # three chunks
    runs = {p: engine.executor.run(feeds, p, cost) for p in POLICIES}
    for p in POLICIES:
        assert all(torch.equal(runs[p][0][k], runs["inorder"][0][k]) for k in runs[p][0]), p
    records = runs["ooo"][1].records
    order = {p: [(r.chunk, r.step) for r in sorted(records, key=lambda r: r.start) if r.processor == p]
             for p in ("npu", "cpu")}
    assert any(o != sorted(o) for o in order.values()), "ooo ran every processor in program order"
    cpu_end = {}
    for r in records:
        if r.processor == "cpu":
            cpu_end[r.chunk] = max(cpu_end.get(r.chunk, 0.0), r.end)
    assert any(r.processor == "npu" and r.start < cpu_end[c] for r in records for c in cpu_end if r.chunk > c)
    bubbles = {p: metrics(runs[p][1])["npu_bubble_rate"] for p in POLICIES}
    assert bubbles["ooo"] < bubbles["inorder"], bubbles


def _slow_attention(engine, monkeypatch) -> dict:
    """Each task made to take a set time before its real work, attention on the CPU the slowest (the
    paper's case): the costs, for a profile."""
    import time

    program = engine.program
    cost = {i: (0.004 if s.sub.kind == "npu" else 0.001 if s.static else 0.012) for i, s in enumerate(program.steps)}

    def timed(i, real):
        def fn(*args):
            time.sleep(cost[i])
            return real(*args)
        return fn

    for i, step in enumerate(program.steps):
        monkeypatch.setattr(step, "fn", timed(i, step.fn))
    return cost


@pytest.mark.parametrize("policy", ["ooo", "overlap"])
def test_an_idle_worker_steals_the_other_lanes_tasks_and_changes_no_bit(engine, monkeypatch, policy):
    """Stealing: a worker with nothing of its own ready runs the other lane's next task. With the CPU
    lane three times the NPU's, the NPU worker must run CPU tasks (as the simulated schedule of the
    same costs does); every task still starts after its dependencies, each worker and each subgraph
    runs one task at a time, and the outputs equal a run without stealing bit for bit."""
    import dataclasses

    from llmnpu_delegate.runtime.schedule import assign_costs, simulate

    cost = _slow_attention(engine, monkeypatch)
    feeds = engine.feeds(torch.randint(0, 1000, (24,)))     # three chunks
    workers = engine.executor.workers
    monkeypatch.setattr(engine.executor, "workers", dataclasses.replace(workers, steal=False))
    alone, plain = engine.executor.run(feeds, policy, cost)
    monkeypatch.setattr(engine.executor, "workers", dataclasses.replace(workers, steal=True))
    got, stats = engine.executor.run(feeds, policy, cost)
    assert plain.stolen == 0 and all(torch.equal(got[k], alone[k]) for k in alone)
    tasks = build_tasks(engine.program, 3)
    assign_costs(tasks, cost)
    assert simulate(tasks, policy, steal=True).stolen > 0
    stolen = [r for r in stats.records if r.processor != tasks[r.task].processor]
    assert stats.stolen == len(stolen) > 0 and any(r.processor == "npu" for r in stolen)
    end = {r.task: r.end for r in stats.records}
    assert len(end) == len(tasks) and all(end[d] <= r.start for r in stats.records for d in tasks[r.task].deps)
    # one task at a time per worker, and per subgraph (a program's method runs one call at a time)
    for key in [("npu", None), ("cpu", None)] + [(None, j) for j in range(len(engine.program.steps))]:
        spans = sorted((r.start, r.end) for r in stats.records if key in ((r.processor, None), (None, r.step)))
        assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), key


def test_an_idle_worker_steals_only_when_its_own_lane_has_nothing_ready():
    from llmnpu_delegate.format.tasks import Task

    # the NPU has a task of its own ready: it takes that, not the CPU's; with none left it takes the
    # CPU's pick (the one the CPU itself would have taken), and the CPU then gets the other one
    tasks = [Task(0, 0, 0, "cpu", [], [2], 1.0), Task(1, 0, 1, "cpu", [], [], 1.0), Task(2, 0, 2, "npu", [0], [], 5.0),
             Task(3, 0, 3, "npu", [], [], 1.0)]
    s = Scheduler(tasks, "ooo", steal=True)
    assert s.pick("npu").id == 3
    assert s.pick("npu").id == Scheduler(tasks, "ooo").pick("cpu").id == 0
    assert s.pick("cpu").id == 1 and s.pick("cpu") is None and s.pick("npu") is None
    plain = Scheduler(tasks, "ooo")
    assert plain.pick("npu").id == 3 and plain.pick("npu") is None


def test_ooo_heuristic_prefers_cpu_work_that_feeds_the_npu():
    from llmnpu_delegate.format.tasks import Task

    # cpu task 0 unlocks an NPU task of 5 s; cpu task 1 unlocks nothing; npu tasks score -cost
    tasks = [Task(0, 1, 0, "cpu", [], [2], 1.0), Task(1, 0, 1, "cpu", [], [], 1.0),
             Task(2, 1, 1, "npu", [0], [], 5.0), Task(3, 0, 2, "npu", [], [], 2.0), Task(4, 0, 3, "npu", [], [], 1.0)]
    s = Scheduler(tasks, "ooo")
    assert s.pick("cpu").id == 0          # even though task 1 comes first in program order
    assert s.pick("npu").id == 4          # the shortest NPU task (score -1 > -2)


def test_ooo_breaks_ties_by_the_chain_of_work_after_a_task():
    from llmnpu_delegate.format.tasks import Task

    # two NPU tasks of the same cost (the same subgraph of chunks 0 and 1): chunk 1's has 3 s of work
    # after it, chunk 0's none; the longer chain runs first, not the earlier chunk
    tasks = [Task(0, 0, 5, "npu", [], [], 1.0), Task(1, 1, 5, "npu", [], [2], 1.0), Task(2, 1, 6, "npu", [1], [], 3.0)]
    assert Scheduler(tasks, "ooo").pick("npu").id == 1
    # with no chain after either, the earlier chunk
    tasks = [Task(0, 0, 5, "npu", [], [], 1.0), Task(1, 1, 5, "npu", [], [], 1.0)]
    assert Scheduler(tasks, "ooo").pick("npu").id == 0


@pytest.mark.parametrize("policy", POLICIES)
def test_a_failing_task_is_reported_and_no_thread_is_left(engine, policy):
    engine(torch.randint(0, 1000, (12,)), policy=policy)      # the workers exist from here on
    before = threading.active_count()
    feeds = engine.feeds(torch.randint(0, 1000, (30,)))
    target = build_tasks(engine.program, len(feeds))[17]
    with pytest.raises(TaskError, match=f"chunk {target.chunk}, subgraph {target.step}") as info:
        engine.executor.run(feeds, policy, fail=target.key)
    assert info.value.task.key == target.key
    assert threading.active_count() == before
    engine(torch.randint(0, 1000, (12,)), policy=policy)      # still usable afterwards
    assert threading.active_count() == before


@pytest.mark.parametrize("wait", ["spin", "block"])
def test_idle_workers_see_every_hand_off_whether_they_spin_or_block(engine, wait, monkeypatch):
    # an idle worker spins on a counter with the GIL released before it sleeps on the condition;
    # every notify, the failure path's included, must reach it either way
    from llmnpu_delegate.runtime import executor

    if wait == "block":
        monkeypatch.setattr(executor.native_ops, "spin_wait", lambda: None)
    ids = torch.randint(0, 1000, (40,), generator=torch.Generator().manual_seed(3))
    base = engine(ids, policy="inorder")
    blocked = 0
    for policy in POLICIES:
        got = engine(ids, policy=policy)
        assert torch.equal(got.logits, base.logits), policy
        stats = engine.last_run
        blocked += stats.waits_blocked
        if wait == "block":
            assert stats.waits_spun == 0, policy
        elif policy == "inorder":     # one task at a time: the idle worker waits at every hand-off
            assert stats.waits_spun > stats.waits_blocked, (stats.waits_spun, stats.waits_blocked)
    # (a run whose workers always found a task to steal waits for nothing: once under `overlap`, in
    # CI; `inorder` runs one task at a time, so its idle worker waits at every hand-off)
    assert blocked > 0 or wait == "spin"
    feeds = engine.feeds(ids)
    target = build_tasks(engine.program, len(feeds))[23]
    with pytest.raises(TaskError, match=f"chunk {target.chunk}, subgraph {target.step}"):
        engine.executor.run(feeds, "ooo", fail=target.key)


def test_runs_reuse_two_worker_threads_with_their_settings(engine):
    # the workers live across runs (they keep their JIT kernels and malloc arena), one per processor,
    # and each run gives them its thread count: a thread keeps the count it saw first otherwise
    import llmnpu_delegate.runtime.executor as ex

    seen = []
    step = engine.program.steps[0]          # the embedding: one task per chunk
    real = step.fn

    def spy(*args):
        seen.append((threading.get_ident(), torch.get_num_threads(), torch.is_inference_mode_enabled()))
        return real(*args)

    step.fn = spy
    try:
        for _ in range(3):
            engine(torch.randint(0, 1000, (12,)), policy="ooo")
    finally:
        step.fn = real
    workers = {t.ident: t.name for t in threading.enumerate() if t.name.startswith("llmnpu-")}
    assert len(seen) >= 3
    # the live workers' threads, run after run (an idle worker may steal the embedding from its lane's)
    assert {ident for ident, _, _ in seen} <= set(workers)
    assert all(n == engine.executor.workers.threads and inference for _, n, inference in seen)
    assert len(workers) == len(ex._POOL)                       # one live thread per worker, none made per run


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_does_not_inherit_the_parents_worker_queues(engine):
    # the parent's workers do not exist in a child: a run there must start its own, not queue
    # jobs for threads that will never take them (a hang)
    import llmnpu_delegate.runtime.executor as ex

    engine(torch.randint(0, 1000, (12,)), policy="ooo")
    assert ex._POOL
    pid = os.fork()
    if pid == 0:
        os._exit(0 if not ex._POOL else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert ex._POOL                                    # the parent keeps its own


def test_workers_split_the_cores_without_oversubscribing():
    w = Workers.auto()
    if w.cores:
        assert not (w.cores["npu"] & w.cores["cpu"])
        assert len(w.cores["npu"]) == w.threads == len(w.cores["cpu"])
    assert w.threads >= 1


def test_profile_is_stored_and_reused(engine):
    assert engine.profile is not None
    path = engine._profile_path()
    assert path.is_file()
    again = type(engine.profile).load(path, engine.program)
    assert again.static == engine.profile.static
    costs = again.costs(6)
    dynamic = next(iter(again.dynamic))
    assert costs[(dynamic, 5)] > 0


def test_profile_is_keyed_on_what_the_program_computes(engine):
    """A stored profile times one program: after a change to any CPU subgraph (a new rewrite, say)
    the engine must profile again, not schedule with the old program's times."""
    program = engine.program
    steps = list(program.steps)
    i = next(i for i, s in enumerate(steps) if s.sub.kind == "cpu")
    gm = copy.deepcopy(steps[i].fn)
    first = next(iter(gm.graph.nodes))
    with gm.graph.inserting_after(first):
        gm.graph.call_function(torch.ops.aten.clone.default, (first,))   # one more op, same outputs
    gm.recompile()
    steps[i] = Step(steps[i].sub, gm)
    other = ChunkProgram(steps, [program.out_logits, *program.out_k, *program.out_v], program.chunk_len,
                         len(program.out_k))
    assert program_digest(program) == program_digest(engine.program)          # deterministic
    assert program_digest(other) != program_digest(program)
    path = engine._profile_path()
    engine.program = other
    try:
        assert engine._profile_path() != path
    finally:
        engine.program = program


def test_profile_is_keyed_on_the_kernels_that_run(engine, monkeypatch):
    # a rebuilt native library (another attention kernel, say) times differently: profile again
    from llmnpu_delegate.kernels import native_ops

    path = engine._profile_path()
    monkeypatch.setitem(native_ops._state, "digest", "another-build")
    assert engine._profile_path() != path


def test_profile_takes_each_tasks_median_over_runs(engine):
    from llmnpu_delegate.runtime.profile import Profile
    from llmnpu_delegate.runtime.schedule import Record

    program = engine.program
    static = next(i for i, s in enumerate(program.steps) if s.static)
    dynamic = next(i for i, s in enumerate(program.steps) if not s.static)
    # three runs of two chunks; one run was disturbed (10x slower)
    runs = [(1.0, 2.0, 3.0, 4.0), (1.2, 2.2, 3.2, 4.2), (10.0, 20.0, 30.0, 40.0)]
    records = [Record(0, chunk, step, "cpu", 0.0, times[2 * k + chunk])
               for times in runs for k, step in enumerate((static, dynamic)) for chunk in (0, 1)]
    profile = Profile.from_records(records, program, program.chunk_len)
    assert profile.static[static] == pytest.approx(1.7)           # median over chunks of (1.2, 2.2)
    assert profile.dynamic[dynamic] == pytest.approx([3.2, 4.2])  # per position, the disturbed run ignored


def test_profile_gives_alike_npu_subgraphs_one_cost(engine):
    """The same NPU region of every layer does the same work: the profile gives them the median of
    their times, so that ooo's cheapest-first rule does not order them by measurement noise. CPU
    subgraphs keep their own times (a shadow path's work differs by layer)."""
    from llmnpu_delegate.runtime.profile import Profile
    from llmnpu_delegate.runtime.schedule import Record

    program = engine.program
    static = [i for i, s in enumerate(program.steps) if s.static]
    records = [Record(0, 0, step, program.steps[step].sub.processor, 0.0, 1.0 + 0.01 * step) for step in static]
    profile = Profile.from_records(records, program, program.chunk_len)
    groups: dict = {}
    for step in static:
        groups.setdefault((program.steps[step].sub.kind, program.steps[step].sub.structure()), []).append(step)
    npu = [g for (kind, _), g in groups.items() if kind == "npu"]
    assert npu and all(len(g) == program.steps[-1].sub.layer + 1 for g in npu)    # one per layer
    for g in npu:
        assert all(profile.static[s] == pytest.approx(1.0 + 0.01 * statistics.median(g)) for s in g)
    cpu = [s for s in static if program.steps[s].sub.kind != "npu"]
    assert all(profile.static[s] == pytest.approx(1.0 + 0.01 * s) for s in cpu)


def test_chunks_before_the_last_skip_the_last_layers_attention_product(engine, monkeypatch):
    """Only the last chunk's logits are read, so the other chunks run the last layer's attention up to
    its K/V. The outputs must equal, bit for bit, those of the partition that does not cut it."""
    import llmnpu_delegate.partitioner.regions as regions
    from llmnpu_delegate.prepare import plan_and_partition
    from llmnpu_delegate.runtime.executor import Executor

    program = engine.program
    product = [i for i, s in enumerate(program.steps) if s.sub.layer == program.steps[-1].sub.layer
               and not s.static and not any(name.startswith("past_") for name in s.sub.inputs)]
    assert len(product) == 1 and product[0] not in program.needed_kv and product[0] in program.needed_final
    ids = torch.randint(0, 1000, (21,), generator=torch.Generator().manual_seed(5))    # three chunks
    got = engine(ids, policy="ooo")
    ran = {(r.chunk, r.step) for r in engine.last_run.records}
    assert (got.chunks - 1, product[0]) in ran and all((c, product[0]) not in ran for c in range(got.chunks - 1))

    monkeypatch.setattr(regions, "_split_for_kv", lambda by_slot, kv: [(s, by_slot[s]) for s in sorted(by_slot)])
    _, partition = plan_and_partition(engine.model, None, engine.fingerprint, engine.chunk_len, engine.quant,
                                      engine.calibration, progress=False)
    whole = ChunkProgram.build(partition, engine.backend, engine.chunk_len, len(program.out_k), attention=engine.attention)
    assert len(whole.steps) == len(program.steps) - 1
    feeds = engine.feeds(ids)
    want = Executor(whole, engine.executor.workers).run(feeds, "inorder")[0]
    out = engine.executor.run(feeds, "ooo", engine.profile.costs(len(feeds)))[0]
    assert want.keys() == out.keys() and all(torch.equal(out[k], want[k]) for k in want)


def test_one_engine_called_from_two_threads(engine):
    """Prompts from two threads: each output equals its single-threaded run, the process-wide
    settings a run changes (torch threads, GC) are restored, and the counters add up."""
    import gc

    prompts = [torch.randint(0, 1000, (n,), generator=torch.Generator().manual_seed(n)) for n in (7, 30, 45)]
    want = [engine(ids).logits for ids in prompts]
    seen = [engine(ids).seen_elements for ids in prompts]
    threads_before, gc_before = torch.get_num_threads(), gc.isenabled()
    got, errors = [], []

    def client():
        try:
            for _ in range(4):
                for i, ids in enumerate(prompts):
                    r = engine(ids)
                    got.append((i, r.logits, r.seen_elements))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert len(got) == 2 * 4 * len(prompts)
    for i, logits, n in got:
        assert torch.equal(logits, want[i]) and n == seen[i]
    assert torch.get_num_threads() == threads_before and gc.isenabled() == gc_before


def test_prefill_function_follows_an_edited_model():
    """prefill() keeps an engine per model: editing a weight in place must give a new one (a new
    fingerprint, so a new calibration and INT8 weights), not the old model's INT8 weights."""
    from llmnpu_delegate.runtime.engine import prefill

    lm = load_model("random:tiny-llama")
    ids = torch.randint(0, 1000, (20,))
    with torch.no_grad():
        old = lm.model(ids[None]).logits[0, -1]
    before = prefill(lm, ids, chunk_len=8, progress=False).logits
    with torch.no_grad():
        lm.model.model.layers[1].mlp.down_proj.weight.mul_(3)
        want = lm.model(ids[None]).logits[0, -1]
    after = prefill(lm, ids, chunk_len=8, progress=False).logits
    edit, error_before, error_after = [float((a - b).abs().max()) for a, b in ((want, old), (before, old), (after, want))]
    assert error_after < 2 * error_before and error_after < 0.25 * edit, (edit, error_before, error_after)


def test_a_broken_task_graph_is_an_error_not_a_hang(engine, monkeypatch):
    """A task waiting for one that never runs (a damaged program's table): every policy reports it."""
    import llmnpu_delegate.runtime.executor as ex
    from llmnpu_delegate.errors import LlmNpuError

    real = ex.build_tasks

    def broken(program, chunks):
        tasks = real(program, chunks)
        tasks[len(tasks) // 2].deps.append(len(tasks))     # no such task: it never finishes
        return tasks

    monkeypatch.setattr(ex, "build_tasks", broken)
    executor = ex.Executor(engine.program, engine.executor.workers)   # the engine's keeps its sound task graphs
    feeds = engine.feeds(torch.randint(0, 1000, (20,)))
    for policy in POLICIES:
        outcome = []
        th = threading.Thread(target=lambda: outcome.append(_raised(executor.run, feeds, policy)))
        th.start()
        th.join(60)
        assert not th.is_alive(), f"{policy}: the executor hung"
        assert isinstance(outcome[0], LlmNpuError) and "cannot finish" in str(outcome[0]), outcome


def _raised(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001 - returned for the assertion
        return e
    return None


def test_kept_schedulers_follow_the_costs_and_start_afresh(engine):
    """A prompt shape keeps its scheduler per policy, stealing and costs: other costs get a scheduler
    ranked on them, the same costs again get the kept one back at its starting state."""
    from llmnpu_delegate.runtime.executor import Executor
    from llmnpu_delegate.runtime.schedule import Scheduler, assign_costs

    shape = Executor(engine.program, engine.executor.workers)._shape(3)
    a = engine.profile.costs(3)
    b = {k: 1e-3 / (1e-4 + v) for k, v in a.items()}       # cheap tasks become dear: other ranks

    def fresh(costs):
        tasks = build_tasks(engine.program, 3)
        assign_costs(tasks, costs)
        return Scheduler(tasks, "ooo")

    first = shape.scheduler("ooo", a, True)
    while first.pick("npu") or first.pick("cpu"):     # spend its ready tasks: state a run leaves behind
        pass
    second = shape.scheduler("ooo", b, True)
    assert second is not first and second.rule.ties == fresh(b).rule.ties != fresh(a).rule.ties
    assert not shape.scheduler("ooo", a, False).steal     # workers that do not steal get their own
    again = shape.scheduler("ooo", a, True)
    assert again is first and again.rule.ties == fresh(a).rule.ties
    start = fresh(a)
    assert (again.missing, again.ready, again.left, again.running) == (start.missing, start.ready, start.left, 0)


def _helping_workers() -> Workers:
    """Two pinned one-thread workers that lend their idle time (``Workers.auto`` turns help off on one
    CPU, which would make the lending checks vanish): skipped, by name, where there are not two CPUs."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if len(cpus) < 2:
        pytest.skip("lending needs two CPUs to pin the workers on")
    return Workers(1, {"npu": {cpus[0]}, "cpu": {cpus[1]}}, True, steal=False)


def _native_int8_path():
    from llmnpu_delegate.kernels import int8_path
    from llmnpu_delegate.kernels.native_ops import native_available

    cpu = int8_path.detect()
    if not native_available():
        return None
    return next((p for p in ("avx2", "avx512", "portable") if int8_path.exact_on(p, cpu)), None)


@pytest.mark.skipif(_native_int8_path() is None, reason=missing("the native kernels (make kernels)"))
@pytest.mark.parametrize("policy", ["inorder", "ooo"])
def test_the_idle_cpu_worker_helps_the_npu_kernels_and_changes_no_bit(calibrated, policy):
    """Workers.help: while the CPU worker has nothing ready it runs pieces of the NPU task's native
    INT8 GEMM. In order it is idle during every NPU task, out of order during many (measured: 367 and
    94 pieces over three runs), so it must have helped; the logits must be those of the same engine
    without help, bit for bit."""
    import dataclasses

    from llmnpu_delegate.kernels import int8_path

    lm, calib = calibrated
    with int8_path.forced(_native_int8_path()):
        eng = Prefiller(lm, 8, quant=QuantConfig(pruning_rate=0.5), calibration=calib, cache=GraphCache(),
                        progress=False, workers=_helping_workers())
        ids = torch.randint(0, 1000, (45,), generator=torch.Generator().manual_seed(9))
        eng.executor.workers = dataclasses.replace(eng.executor.workers, help=False)
        alone = eng(ids, policy=policy).logits
        assert eng.last_run.pieces_lent == 0
        eng.executor.workers = dataclasses.replace(eng.executor.workers, help=True)
        lent = 0
        for _ in range(3):
            got = eng(ids, policy=policy).logits
            assert torch.equal(got, alone)
            lent += eng.last_run.pieces_lent
    assert lent > 0, policy



def _bf16_attention_without_native_int8():
    """A non-native exact INT8 path for this CPU when bf16 attention runs here (so only the NPU
    worker has kernels to help with), else None."""
    from llmnpu_delegate.kernels import int8_path
    from llmnpu_delegate.kernels.native_ops import bf16_attention_available

    if not bf16_attention_available():
        return None
    cpu = int8_path.detect()
    return next((p for p in ("onednn", "int_mm") if int8_path.exact_on(p, cpu)), None)


@pytest.mark.skipif(_bf16_attention_without_native_int8() is None, reason="no bf16 attention kernel here")
def test_the_idle_npu_worker_helps_the_attention_and_changes_no_bit(calibrated):
    """Workers.help, the other way: while the NPU worker has nothing ready it runs pieces of the CPU
    task's bf16 attention. A continuation over a long past (several pieces per call), in order (the
    NPU worker idles through every CPU task): with INT8 linears that are not native, every lent piece
    is attention's; logits and K/V equal those of the same engine without help, bit for bit."""
    import dataclasses

    from llmnpu_delegate.kernels import int8_path

    lm, calib = calibrated
    with int8_path.forced(_bf16_attention_without_native_int8()):
        eng = Prefiller(lm, 8, quant=QuantConfig(pruning_rate=0.5), calibration=calib, cache=GraphCache(),
                        progress=False, attention="bf16", workers=_helping_workers())
        gen = torch.Generator().manual_seed(12)
        head = eng(torch.randint(0, 1000, (300,), generator=gen), policy="inorder")
        ids = torch.randint(0, 1000, (20,), generator=gen)
        past = (head.past_k, head.past_v)
        eng.executor.workers = dataclasses.replace(eng.executor.workers, help=False)
        alone = eng(ids, policy="inorder", past=past)
        assert eng.last_run.pieces_lent == 0
        eng.executor.workers = dataclasses.replace(eng.executor.workers, help=True)
        lent = 0
        for _ in range(3):
            got = eng(ids, policy="inorder", past=past)
            assert torch.equal(got.logits, alone.logits)
            assert all(torch.equal(a, b) for a, b in zip(got.past_k + got.past_v, alone.past_k + alone.past_v))
            lent += eng.last_run.pieces_lent
    assert lent > 0