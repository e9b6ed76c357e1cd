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
