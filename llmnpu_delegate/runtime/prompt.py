"""A prompt on its way through a chunk program: checked, cut into chunk feeds, and the outputs
gathered into a ``PrefillResult``. One place for every runner of a chunk program (the engine's
``Prefiller`` and the ``.pte`` runner)."""
from __future__ import annotations

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

    @property
    def outlier_share(self) -> float:
        return self.outlier_elements / self.seen_elements if self.seen_elements else 0.0

    @property
    def tokens(self) -> int:
        return self.past_k[0].shape[2]


def check_prompt(input_ids, max_context: int, vocab: int) -> Tensor:
    """``input_ids`` as a 1-D int64 tensor, or an LlmNpuError that says what is wrong with it."""
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2:
        if ids.shape[0] != 1:
            raise LlmNpuError(f"prefill runs one prompt at a time (batch 1), got a batch of {ids.shape[0]}")
        ids = ids[0]
    if ids.dim() != 1 or ids.dtype not in (torch.int64, torch.int32):
        raise LlmNpuError(f"input_ids must be a 1-D (or [1, T]) integer tensor, got {tuple(ids.shape)} {ids.dtype}")
    if ids.numel() == 0:
        raise LlmNpuError("the prompt is empty: give at least one token")
    if ids.numel() > max_context:
        raise LlmNpuError(f"the prompt has {ids.numel()} tokens, more than the context of "
                          f"{max_context}: shorten it")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise LlmNpuError(f"token ids must lie in [0, {vocab}), got [{int(ids.min())}, {int(ids.max())}]")
    return ids.to(torch.int64)


def chunk_feeds(ids: Tensor, chunk_len: int, kv) -> list[dict[str, Tensor]]:
    """Per chunk of a checked 1-D prompt: its ids (the last chunk padded with 0 at its end),
    positions and the row whose logits are wanted; the first chunk also gets the empty past K/V
    (later chunks get theirs from the chunk before)."""
    c = chunk_len
    feeds = []
    for position, start in enumerate(range(0, ids.numel(), c)):
        part = ids[start:start + c]
        chunk = torch.nn.functional.pad(part, (0, c - part.numel()))[None]
        feeds.append({"input_ids": chunk, "cache_position": torch.arange(start, start + c),
                      "logits_index": torch.tensor([part.numel() - 1])})
    empty = torch.zeros(1, kv.kv_heads, 0, kv.head_dim)
    feeds[0].update({past_name(kind, i): empty for kind in "kv" for i in range(kv.layers)})
    return feeds


def gather(program, out: dict, total: int, chunks: int, stats) -> PrefillResult:
    """The executor's outputs of a ``total``-token prompt (``chunks`` chunks) as a ``PrefillResult``:
    the last real token's logits, and each layer's K/V without the last chunk's padding."""
    return PrefillResult(out[program.out_logits].reshape(-1),
                         [out[k][:, :, :total] for k in program.out_k],
                         [out[v][:, :, :total] for v in program.out_v],
                         chunks, {"prefill_s": stats.wall_s})
