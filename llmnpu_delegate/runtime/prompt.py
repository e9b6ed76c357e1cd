"""A prompt on its way through a chunk program: checked, cut into chunk feeds, and the outputs
gathered into a ``PrefillResult``. One place for every runner of a chunk program (the engine's
``Prefiller`` and the ``.pte`` runner).

A prompt may continue a past: the K/V of the ``P`` tokens before it (a conversation's earlier
turns, a cached prefix). Its chunks then start at position ``P``, whatever ``P`` is: the chunk
graphs take positions as inputs and the past length is symbolic in every attention subgraph, so a
continuation that starts mid-chunk needs no partial first chunk, and pads only its last chunk, as a
prompt from an empty past does. A runner with a tail program (a second program of fewer rows) runs
a last part that fits there as that many rows instead (``chunk_rows``)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..errors import LlmNpuError
from ..format.tasks import past_name


@dataclass
class PrefillResult:
    logits: Tensor                 # [V] logits of the last prompt token
    past_k: list[Tensor]           # per layer [1, KVH, T, d]
    past_v: list[Tensor]
    chunks: int
    timings: dict = field(default_factory=dict)
    # Activation elements of this prompt that entered shadowed linears, and those sent to the shadow path.
    seen_elements: int = 0
    outlier_elements: int = 0
    reused: int = 0                # tokens whose K/V came from a past (given, or a prefix cache), not computed
    rows: int = 0                  # rows the chunks ran, padding included

    @property
    def outlier_share(self) -> float:
        return self.outlier_elements / self.seen_elements if self.seen_elements else 0.0

    @property
    def tokens(self) -> int:
        return self.past_k[0].shape[2]


def check_prompt(input_ids, max_context: int, vocab: int, past_len: int = 0) -> Tensor:
    """``input_ids`` as a 1-D int64 tensor, or an LlmNpuError that says what is wrong with it
    (``past_len``: tokens of a past it continues, which count against the context)."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise LlmNpuError(f"prefill runs one prompt at a time (batch 1), got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise LlmNpuError(f"input_ids must be a 1-D (or [1, T]) integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() == 0:
        raise LlmNpuError("the prompt is empty: give at least one token")
    if past_len + ids.numel() > max_context:
        after = f" after a past of {past_len}" if past_len else ""
        raise LlmNpuError(f"the prompt has {ids.numel()} tokens{after}, more than the context of "
                          f"{max_context}: shorten it")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise LlmNpuError(f"token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
    return ids.to(torch.int64)


def check_past(past, kv) -> tuple[list[Tensor], list[Tensor]]:
    """``past`` as (per-layer K, per-layer V), each [1, KVH, P, d] float32 with one P for every
    layer, or an LlmNpuError naming what does not fit the model."""
    try:
        past_k, past_v = (list(x) for x in past)
    except (TypeError, ValueError):
        raise LlmNpuError("past must be a pair (past_k, past_v) of per-layer tensor lists") from None
    if len(past_k) != kv.layers or len(past_v) != kv.layers:
        raise LlmNpuError(f"past has K/V for {len(past_k)}/{len(past_v)} layers, the model has {kv.layers}")
    length = past_k[0].shape[2] if past_k[0].dim() == 4 else -1
    want = (1, kv.kv_heads, length, kv.head_dim)
    for t in past_k + past_v:
        if tuple(t.shape) != want or t.dtype != torch.float32:
            raise LlmNpuError(f"past K/V must be [1, {kv.kv_heads}, P, {kv.head_dim}] float32 with one P for "
                              f"every layer, got {tuple(t.shape)} {t.dtype}")
    return past_k, past_v


def chunk_rows(tokens: int, chunk_len: int, tail_len: int | None = None) -> list[int]:
    """Rows of each chunk of a ``tokens``-token prompt: ``chunk_len`` each, except that a last
    part of at most ``tail_len`` tokens runs as one chunk of ``tail_len`` rows (a runner with a
    tail program) instead of a whole padded chunk."""
    rows = [chunk_len] * math.ceil(tokens / chunk_len)
    rest = tokens % chunk_len
    if tail_len and 0 < rest <= tail_len < chunk_len:
        rows[-1] = tail_len
    return rows


def chunk_feeds(ids: Tensor, chunk_len: int, kv, past: tuple[list[Tensor], list[Tensor]] | None = None,
                tail_len: int | None = None) -> list[dict[str, Tensor]]:
    """Per chunk of a checked 1-D prompt: its ids (the last chunk padded with 0 at its end, to
    ``tail_len`` rows when its tokens fit there, see ``chunk_rows``), positions and the row whose
    logits are wanted; the first chunk also gets the past K/V (empty, or a checked ``past`` whose
    ``P`` tokens come before the prompt; later chunks get theirs from the chunk before)."""
    p = past[0][0].shape[2] if past is not None else 0
    feeds = []
    start = 0
    for c in chunk_rows(ids.numel(), chunk_len, tail_len):
        part = ids[start:start + c]
        chunk = torch.nn.functional.pad(part, (0, c - part.numel()))[None]
        feeds.append({"input_ids": chunk, "cache_position": torch.arange(p + start, p + start + c),
                      "logits_index": torch.tensor([part.numel() - 1])})
        start += c
    if past is None:
        empty = torch.zeros(1, kv.kv_heads, 0, kv.head_dim)
        past = ([empty] * kv.layers, [empty] * kv.layers)
    for kind, tensors in zip("kv", past):
        feeds[0].update({past_name(kind, i): t for i, t in enumerate(tensors)})
    return feeds


def gather(program, out: dict, total: int, feeds: list[dict], stats, reused: int = 0) -> PrefillResult:
    """The executor's outputs of a prompt that ends at ``total`` tokens (``reused`` of them its
    past), run as the chunks ``feeds``, as a ``PrefillResult``: the last real token's logits, and
    each layer's K/V of all ``total`` tokens without the last chunk's padding."""
    return PrefillResult(out[program.out_logits].reshape(-1),
                         [out[k][:, :, :total] for k in program.out_k],
                         [out[v][:, :, :total] for v in program.out_v],
                         len(feeds), {"prefill_s": stats.wall_s}, reused=reused,
                         rows=sum(f["input_ids"].shape[-1] for f in feeds))
