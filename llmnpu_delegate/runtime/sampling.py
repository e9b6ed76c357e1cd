"""Choosing the next token from logits: greedy, or temperature with nucleus (top-p) sampling.

``Sampling`` is the one description of how, checked once where it is made and handed to every runner:
the Python ``.pte`` runner draws with ``next_token``, the native runner gets ``native_args``, the
Hugging Face wrapper ``generate_kwargs``."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..errors import LlmNpuError


@dataclass(frozen=True)
class Sampling:
    """``temperature`` None: greedy; else a draw at that temperature from the smallest set of most
    likely tokens whose probabilities reach ``top_p``. ``seed``: the draws' random seed."""
    temperature: float | None = None
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self):
        if self.temperature is not None and not self.temperature > 0:
            raise LlmNpuError(f"temperature must be positive (omit it for greedy decoding), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise LlmNpuError(f"top-p must be in (0, 1], got {self.top_p}")

    def generator(self) -> torch.Generator | None:
        return torch.Generator().manual_seed(self.seed) if self.seed is not None else None

    def next_token(self, logits: Tensor, generator: torch.Generator | None = None) -> int:
        return next_token(logits, self.temperature, self.top_p, generator)

    def native_args(self) -> list[str]:
        """``llmnpu-runner``'s options for this sampling."""
        args = [] if self.temperature is None else ["--temperature", repr(float(self.temperature)),
                                                    "--top-p", repr(float(self.top_p))]
        return args + ([] if self.seed is None else ["--seed", str(self.seed)])

    def generate_kwargs(self) -> dict:
        """transformers ``generate``'s options for this sampling (its seed is torch's global one)."""
        if self.temperature is None:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": self.temperature, "top_p": self.top_p}


GREEDY = Sampling()


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
