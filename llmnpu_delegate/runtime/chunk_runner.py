"""One prompt's prefill through a chunk program: the single call path that the engine
(``engine.py``, which builds its program from the model) and the ``.pte`` runner (``pte_runner.py``,
which builds it from the program file's methods) both serve from.

The path: check the prompt (and a given past), take the longest cached prefix when a prefix cache
is kept, cut the rest into chunk feeds, run the executor under the policy with the profiled costs
(a cost-driven policy without a profile runs in order instead, and may time that run), gather the
last logits and the K/V.
"""
from __future__ import annotations

import threading

import torch
from torch import Tensor

from ..chunk_step import KVShape
from ..errors import LlmNpuError
from .executor import Executor, Workers
from .prefix_cache import PrefixCache
from .profile import Profile
from .program import ChunkProgram
from .prompt import PrefillResult, check_past, check_prompt, chunk_feeds, gather
from .schedule import COST_POLICIES, RunStats, check_policy


class ChunkRunner:
    """Prefills prompts of any length with ``program`` (chunks of ``program.chunk_len`` rows; a last
    part that fits ``tail``'s rows runs on that program instead) under a scheduling ``policy``.

    ``runner(ids)`` returns a ``PrefillResult``. ``past``: (per-layer K, per-layer V) of tokens that
    come before ``ids``; without it, a runner with a ``prefix_cache`` prefills only what follows the
    longest cached prefix of ``ids`` (entries are kept under ``kv_key``, which names everything a
    prompt's K/V depend on). Safe to call from several threads: prompts run one after another."""

    learns_profile = True        # an in-order run of a whole chunk prompt becomes the profile
    contiguous_past = False      # the steps take contiguous past K/V only (ExecuTorch methods)

    def __init__(self, program: ChunkProgram, kv: KVShape, context: int, vocab: int, policy: str = "ooo",
                 workers: Workers | None = None, tail: ChunkProgram | None = None, profile: Profile | None = None,
                 prefix_cache: PrefixCache | None = None, kv_key: str = ""):
        self.program, self.tail, self.kv = program, tail, kv
        self.chunk_len, self.tail_len = program.chunk_len, tail.chunk_len if tail else None
        self.context, self.vocab, self.policy = context, vocab, check_policy(policy)
        self.executor = Executor(program, workers, tail)
        self.profile, self.prefix_cache, self.kv_key = profile, prefix_cache, kv_key
        self.last_run: RunStats | None = None
        self.released = False
        self._lock = threading.Lock()       # one prompt at a time: profile, counters, last_run

    def check_prompt(self, input_ids, past_len: int = 0) -> Tensor:
        return check_prompt(input_ids, self.context, self.vocab, past_len)

    def feeds(self, ids: Tensor, past=None) -> list[dict[str, Tensor]]:
        """Per chunk of ``chunk_len`` rows (the main program's, which export and validation step
        through): its ids, positions and logits row (the past K/V arrive from the previous chunk,
        the first chunk's from ``past``: empty by default)."""
        return chunk_feeds(ids, self.chunk_len, self.kv, past)

    def __call__(self, input_ids, policy: str | None = None, past=None) -> PrefillResult:
        """Prefill one prompt; with ``past``, the result holds the K/V of the past and the prompt."""
        policy = check_policy(policy or self.policy)
        past = check_past(past, self.kv) if past is not None else None
        ids = self.check_prompt(input_ids, past[0][0].shape[2] if past is not None else 0)
        return self.prefill_checked(ids, policy, past)

    @torch.inference_mode()
    def prefill_checked(self, ids: Tensor, policy: str, past=None) -> PrefillResult:
        """``__call__`` for a prompt, policy and past that are checked already (``check_prompt``)."""
        with self._lock:
            if past is not None or self.prefix_cache is None:
                return self._run(ids, policy, past)
            return self.prefix_cache.prefill(self.kv_key, ids, lambda x, p: self._run(x, policy, p))

    def _run(self, ids: Tensor, policy: str, past=None) -> PrefillResult:
        if self.released:
            raise LlmNpuError("this runner's compiled steps were released (release_runtime): build a new one "
                              "to run prompts")
        reused = past[0][0].shape[2] if past is not None else 0
        if past is not None and self.contiguous_past:       # a cached prefix is a slice
            past = tuple([t.contiguous() for t in ts] for ts in past)
        feeds = chunk_feeds(ids, self.chunk_len, self.kv, past, self.tail_len)
        last_rows = feeds[-1]["input_ids"].shape[-1]
        seen0, outliers0 = self._outlier_counts()
        run_policy = "inorder" if policy in COST_POLICIES and self.profile is None else policy
        costs = (self.profile.costs(len(feeds), reused / self.chunk_len, last_rows / self.chunk_len)
                 if self.profile else None)
        out, stats = self.executor.run(feeds, run_policy, costs)
        for store in self.row_stores():
            store.settle()      # their channel lists, kept across prompts, fragment the workers' heaps
        if (self.learns_profile and self.profile is None and run_policy == "inorder" and not reused
                and last_rows == self.chunk_len):
            self.profile = Profile.from_records(stats.records, self.program, self.chunk_len)
            self.profiled(self.profile)
        self.last_run = stats
        result = gather(self.program, out, reused + ids.numel(), feeds, stats, reused)
        seen, outliers = self._outlier_counts()
        result.seen_elements, result.outlier_elements = seen - seen0, outliers - outliers0
        return result

    def profiled(self, profile: Profile) -> None:
        """Called with a profile made from a prompt's in-order run (the engine stores it)."""

    def row_stores(self) -> list:
        """The shadow rows' stores (``format/rows.RowStore``) that this runner's steps read."""
        return [m.rows for m in self.program.shadow.values()]

    def _outlier_counts(self) -> tuple[int, int]:
        shadows = self.program.shadow.values()
        return sum(m.seen_elements for m in shadows), sum(m.outlier_elements for m in shadows)
