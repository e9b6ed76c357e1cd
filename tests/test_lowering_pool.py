"""``lower/lowering_pool.py``: forked lowering workers answer every job, in fresh processes per batch, and a
worker that fails or dies stops the run with an error instead of a wait."""
import collections
import os
import signal

import pytest

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.lower.lowering_pool import JOBS_PER_WORKER, Claims, run_jobs


def _square(state, job):
    return job, job * job + state, os.getpid()


def test_every_job_answered_in_batches_of_fresh_processes():
    jobs = list(range(3 * JOBS_PER_WORKER + 2))
    got = list(run_jobs(_square, 10, jobs, workers=2))
    assert sorted((j, v) for j, v, _ in got) == [(j, j * j + 10) for j in jobs]
    pids = collections.Counter(pid for _, _, pid in got)
    first = next(pid for j, _, pid in got if j == 0)
    assert pids[first] == 1                          # the first (longest) job alone in its process
    assert max(pids.values()) <= JOBS_PER_WORKER and os.getpid() not in pids
    # one worker: this process, in order
    assert [j for j, _, pid in run_jobs(_square, 0, jobs, workers=1)] == jobs


def _group(state, job):
    return [(j, os.getpid()) for j in job]


def test_a_job_of_several_methods_counts_each_in_its_workers_batch():
    """Export lowers one block's QNN methods as one job: a batch holds ``JOBS_PER_WORKER`` methods,
    not that many jobs, so a process lowers no more than a batch of single jobs would."""
    jobs = [(0,), *[tuple(range(k, k + 3)) for k in range(1, 40, 3)]]
    got = [r for rs in run_jobs(_group, None, jobs, workers=2, weight=len) for r in rs]
    assert sorted(j for j, _ in got) == list(range(40))
    per_process = collections.Counter(pid for _, pid in got)
    assert max(per_process.values()) == JOBS_PER_WORKER // 3 * 3        # whole jobs, as many as fit
    # counted as one each, a process would take JOBS_PER_WORKER of them: three times the methods
    got = [r for rs in run_jobs(_group, None, jobs, workers=2) for r in rs]
    assert max(collections.Counter(pid for _, pid in got).values()) == 3 * JOBS_PER_WORKER


def _fails(state, job):
    if job == 5:
        raise LlmNpuError("job 5 cannot be lowered")
    return job


def _dies(state, job):
    if job == 3:
        os.kill(os.getpid(), signal.SIGKILL)          # as the out-of-memory killer would
    return job


class _KilledWhileSent:
    """Kills its process while its result is being written out, after some bytes of it."""

    def __reduce__(self):
        os.kill(os.getpid(), signal.SIGKILL)


def _dies_sending(state, job):
    return (b"x" * (1 << 22), _KilledWhileSent()) if job == 3 else job


def test_a_failing_or_dying_worker_is_an_error_not_a_wait(tmp_path):
    with pytest.raises(LlmNpuError, match="job 5 cannot be lowered"):
        list(run_jobs(_fails, None, range(12), workers=2))
    with pytest.raises(LlmNpuError, match="killed by signal 9 .*fewer --workers"):
        list(run_jobs(_dies, None, range(12), workers=2))
    # killed halfway through its result (a pipe would leave the parent waiting for the rest)
    with pytest.raises(LlmNpuError, match="killed by signal 9"):
        list(run_jobs(_dies_sending, None, range(12), workers=2, spool=tmp_path))
    assert list(tmp_path.iterdir()) == []            # no result file left behind


def _claim(claims, job):
    return job, claims.first(job % 3)


def test_a_key_is_claimed_once_across_workers():
    with Claims() as claims:
        got = list(run_jobs(_claim, claims, range(12), workers=2))
    firsts = [j for j, first in got if first]
    assert len(firsts) == 3 and sorted(j % 3 for j in firsts) == [0, 1, 2]
    assert not os.path.exists(claims.folder)
