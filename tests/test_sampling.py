"""runtime/sampling.py: one Sampling for every runner, checked where it is made."""
import pytest
import torch

from llmnpu_delegate.errors import LlmNpuError
from llmnpu_delegate.runtime.sampling import GREEDY, Sampling


def test_greedy_takes_the_argmax_and_a_nucleus_never_draws_outside_it():
    logits = torch.tensor([0.0, 3.0, 2.9, -1.0, 1.0])
    assert GREEDY.next_token(logits) == 1
    # p(1) ~ 0.45, p(2) ~ 0.41: top_p 0.8 keeps exactly those two, whatever the draw
    nucleus = Sampling(1.0, 0.8, seed=0)
    gen = nucleus.generator()
    draws = {nucleus.next_token(logits, gen) for _ in range(400)}
    assert draws == {1, 2}
    # without the nucleus, the 1.0 logit (p ~ 0.06) is drawn too
    gen = Sampling(1.0, seed=0).generator()
    assert 4 in {Sampling(1.0).next_token(logits, gen) for _ in range(400)}


def test_a_seed_repeats_its_draws():
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    s = Sampling(0.9, 0.95, seed=7)
    runs = [[s.next_token(logits, g) for _ in range(20)] for g in (s.generator(), s.generator())]
    assert runs[0] == runs[1] and len(set(runs[0])) > 1


def test_bad_values_are_refused_and_each_runner_gets_its_own_form():
    for bad, match in (((0.0,), "temperature must be positive"), ((-1.0,), "temperature must be positive"),
                       ((0.8, 0.0), "top-p must be in"), ((0.8, 1.5), "top-p must be in")):
        with pytest.raises(LlmNpuError, match=match):
            Sampling(*bad)
    assert GREEDY.native_args() == [] and GREEDY.generate_kwargs() == {"do_sample": False}
    s = Sampling(0.5, 0.9, 3)
    assert s.native_args() == ["--temperature", "0.5", "--top-p", "0.9", "--seed", "3"]
    assert s.generate_kwargs() == {"do_sample": True, "temperature": 0.5, "top_p": 0.9}
