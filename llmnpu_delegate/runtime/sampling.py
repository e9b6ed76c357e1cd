"""Choosing the next token from logits: greedy, or temperature with nucleus (top-p) sampling."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import LlmNpuError


def check_sampling(temperature: float | None, top_p: float) -> None:
    if temperature is not None and not temperature > 0:
        raise LlmNpuError(f"temperature must be positive (omit it for greedy decoding), got {temperature}")
    if not 0 < top_p <= 1:
        raise LlmNpuError(f"top-p must be in (0, 1], got {top_p}")


def next_token(logits: Tensor, temperature: float | None = None, top_p: float = 1.0,
               generator: torch.Generator | None = None) -> int:
    """Greedy when ``temperature`` is None; otherwise a draw from the smallest set of most likely
    tokens whose probabilities reach ``top_p``, at ``temperature``."""
    if temperature is None:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        keep = sorted_p.cumsum(0) - sorted_p < top_p          # tokens before which the mass is below top_p
        probs = torch.zeros_like(probs).scatter_(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs, 1, generator=generator))
