"""``tune_malloc`` keeps a prefill's working set mapped between runs (``runtime/allocator.py``).

The workload is the executor's, in a fresh interpreter: two long-lived worker threads allocate
blocks of a chunk's activation sizes, hand some to the other side and keep others, and the caller
frees what they made, run after run. The control sets only the mmap and trim thresholds (glibc's
top pad as it comes): a worker arena then unmaps a heap once it is free, and a later run faults it
in again (~10,000 minor faults in one run of three, measured).
"""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc settings")

WORKLOAD = r"""
import ctypes, ctypes.util, queue, random, resource, threading
if {tuned}:
    from llmnpu_delegate.runtime.allocator import tune_malloc
    assert tune_malloc()
else:
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    assert libc.mallopt(-3, 32 << 20) == 1 and libc.mallopt(-1, 1 << 30) == 1
import torch

SIZES = [(256, 576), (256, 3072), (256, 1536), (256, 960), (256, 768)]     # smollm2's, one chunk
made = queue.SimpleQueue()

def work(seed):
    rng = random.Random(seed)
    held = []
    for _ in range(120):
        held.append(torch.ones(*SIZES[rng.randrange(len(SIZES))]))
        if len(held) > 40:
            made.put(held.pop(rng.randrange(len(held))))
    for t in held:
        made.put(t)

jobs = [queue.SimpleQueue() for _ in range(2)]
def serve(q):
    while True:
        job, done = q.get(); job(); done.set()
for q in jobs:
    threading.Thread(target=serve, args=(q,), daemon=True).start()

def run(r):
    events = [threading.Event() for _ in jobs]
    for i, (q, e) in enumerate(zip(jobs, events)):
        q.put((lambda i=i: work(2 * (r % 3) + i), e))
    for e in events:
        e.wait()
    while not made.empty():
        made.get()

for r in range(3):
    run(r)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for r in range(3, 13):
    run(r)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(tuned: bool) -> int:
    """Minor faults of ten runs after three warm-up runs."""
    out = subprocess.run([sys.executable, "-c", WORKLOAD.format(tuned=tuned)], capture_output=True, text=True,
                         check=True, timeout=300)
    return int(out.stdout.strip().splitlines()[-1])


def test_tune_malloc_keeps_the_workers_heaps_mapped():
    # how the threads interleave decides which run unmaps a heap: the control gets three processes
    plain, tuned = max(_faults(False) for _ in range(3)), _faults(True)
    assert plain > 3_000, f"control: expected freed heaps to fault again, saw {plain} faults"
    assert tuned < plain / 10, f"{tuned} faults over ten runs with tune_malloc (control {plain})"
