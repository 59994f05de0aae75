"""Sampling: banned (input-only) token ids are never chosen, and the logprob stays the model's."""

from __future__ import annotations

import math

import torch

from relax.engines.native.sampling import generator_for, sample
from relax.engines.types import SamplingParams


def test_banned_ids_are_never_sampled_and_logprobs_are_unmasked():
    # logits (1, 3) = [0, 5, 0]; id 1 holds e^5 / (e^5 + 2) = 98.7 % of the mass but is banned, so
    # sampling picks 0 or 2 (half each); the logprob is still log softmax of the full row:
    # log(1 / (e^5 + 2)) = -5.0134
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    banned = torch.tensor([1])
    seen = set()
    for seed in range(40):
        (tok,), (lp,) = sample(logits, [SamplingParams(temperature=1.0)], [generator_for(seed)], banned)
        seen.add(tok)
        assert math.isclose(lp, -math.log(math.exp(5.0) + 2.0), rel_tol=1e-5)
    assert seen == {0, 2}


def test_greedy_skips_a_banned_argmax():
    # argmax is id 1 (banned); the best allowed id is 2 (logit 1 > 0)
    (tok,), _ = sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=0.0)], [generator_for(0)],
                       torch.tensor([1]))
    assert tok == 2
    (tok,), _ = sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=0.0)], [generator_for(0)])
    assert tok == 1  # without the ban the argmax wins
