"""glibc's allocator, tuned for prefill-sized temporaries.

By default glibc serves allocations above a (dynamic) threshold with fresh ``mmap`` pages and gives
them back on free, so every multi-MiB activation of a chunk page-faults anew on each call: measured
here, a 256x4864 gate/up W8A8 pair takes 15.6 ms that way and 8.9 ms with the threshold raised.
Raising the mmap threshold to its maximum (32 MiB) and the trim threshold keeps such blocks in the
heap for reuse. Process-wide, so the baselines of a benchmark in the same process profit as well.

Threads leak pages as well. Each thread has its own arena, made of 64 MiB heaps, and glibc unmaps
such a heap as soon as it is wholly free, unless the heap before it has less than the *top pad*
left. The executor's workers allocate each chunk's activations and K/V and free them by the end of
the run, so with threads made per run and the default pad, every prefill faulted its working set
in anew: on the embedded model at 1,024 tokens, 25,000-40,000 minor faults and 0.06-0.45 s of
system time per run (runs 20-80 % slower, by how busy the host was). The executor now keeps its
two workers (and their arenas), and a pad of one whole heap keeps their heaps: 0 faults per run
after the first, where the default pad still gave ~10,000 in one run of three.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_HEAP_MAX = 64 << 20      # glibc's HEAP_MAX_SIZE on 64-bit
_done = False


def _glibc(call: str, *args: int) -> bool:
    """glibc's ``call(*args) == 1`` (its "done"); False off Linux or without glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return getattr(libc, call)(*args) == 1
    except (OSError, AttributeError):
        return False


def _mallopt(option: int, value: int) -> bool:
    return _glibc("mallopt", option, value)


def tune_malloc(mmap_threshold: int = 32 << 20, trim_threshold: int = 1 << 30, top_pad: int = _HEAP_MAX) -> bool:
    """Apply once per process; True if glibc accepted it (False elsewhere: nothing to do)."""
    global _done
    if _done:
        return True
    ok = all(_mallopt(option, value) for option, value in (
        (_M_MMAP_THRESHOLD, mmap_threshold), (_M_TRIM_THRESHOLD, trim_threshold), (_M_TOP_PAD, top_pad)))
    _done = ok
    return ok


def tuned() -> bool:
    return _done


def give_back() -> bool:
    """Return the free pages of every malloc arena to the system (glibc's ``malloc_trim``); True if
    glibc did. With the thresholds above, blocks of up to 32 MiB come from the heap and stay there
    when freed, so memory let go in bulk (an engine's runtime, released before ``llmnpu export``
    forks its workers) would otherwise stay in the process: 4.8 GiB of the Qwen1.5-1.8B export's."""
    return _glibc("malloc_trim", 0)
