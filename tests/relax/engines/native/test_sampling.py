"""Sampling: inverse-CDF draws from per-sequence uniform streams; banned (input-only) token ids are
never chosen, and the logprob stays the model's."""

from __future__ import annotations

import math

import torch

from relax.engines.native.sampling import UniformStream, generator_for, sample
from relax.engines.types import SamplingParams


def test_banned_ids_are_never_sampled_and_logprobs_are_unmasked():
    # logits (1, 3) = [0, 5, 0]; id 1 holds e^5 / (e^5 + 2) = 98.7 % of the mass but is banned, so
    # sampling picks 0 or 2 (half each); the logprob is still log softmax of the full row:
    # log(1 / (e^5 + 2)) = -5.0134
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    banned = torch.tensor([1])
    seen = set()
    for seed in range(40):
        (tok,), (lp,) = sample(logits, [SamplingParams(temperature=1.0)], [UniformStream(seed).next()], banned)
        seen.add(tok)
        assert math.isclose(lp, -math.log(math.exp(5.0) + 2.0), rel_tol=1e-5)
    assert seen == {0, 2}


def test_greedy_skips_a_banned_argmax():
    # argmax is id 1 (banned); the best allowed id is 2 (logit 1 > 0)
    (tok,), _ = sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=0.0)], [0.5],
                       torch.tensor([1]))
    assert tok == 2
    (tok,), _ = sample(torch.tensor([[0.0, 5.0, 1.0]]), [SamplingParams(temperature=0.0)], [0.5])
    assert tok == 1  # without the ban the argmax wins


def test_inverse_cdf_picks_the_token_whose_cumulative_mass_covers_the_uniform():
    # probs (3,) = [0.2, 0.3, 0.5] -> cdf [0.2, 0.5, 1.0]; u = 0.1 falls in [0, 0.2) -> id 0,
    # u = 0.25 in [0.2, 0.5) -> id 1, u = 0.6 in [0.5, 1.0) -> id 2; logprobs log 0.2, log 0.3, log 0.5
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log().expand(3, -1)
    tokens, lps = sample(logits, [SamplingParams(temperature=1.0)] * 3, [0.1, 0.25, 0.6])
    assert tokens == [0, 1, 2]
    assert [round(x, 5) for x in lps] == [round(math.log(p), 5) for p in (0.2, 0.3, 0.5)]


def test_a_uniform_stream_yields_one_draw_per_call_of_its_generator_across_chunks():
    # chunks of 4 over 10 draws: the same numbers as ten single draws from the same seed, so
    # drawing ahead does not change what a seeded request samples
    stream, g = UniformStream(7, chunk=4), generator_for(7)
    assert [stream.next() for _ in range(10)] == [torch.rand((), generator=g, dtype=torch.float64).item()
                                                  for _ in range(10)]



def test_repetition_frequency_and_presence_penalties_by_hand():
    # logits [2, -1, 1]; prompt [0], output [1, 1]
    # repetition r = 2 on seen {0, 1}: 2 / 2 = 1, -1 * 2 = -2, unseen 1 stays -> [1, -2, 1]
    # frequency 0.5 and presence 0.25 over the output (token 1 twice): -1 - 0.5 * 2 - 0.25 = -2.25 -> [2, -2.25, 1]
    from relax.engines.native.sampling import penalise

    z = torch.tensor([2.0, -1.0, 1.0])
    rep = penalise(z, SamplingParams(repetition_penalty=2.0), [0], [1, 1])
    assert rep.tolist() == [1.0, -2.0, 1.0]
    freq = penalise(z, SamplingParams(frequency_penalty=0.5, presence_penalty=0.25), [0], [1, 1])
    assert freq.tolist() == [2.0, -2.25, 1.0]
    assert z.tolist() == [2.0, -1.0, 1.0]  # a copy: the model's logits are left alone


def test_penalties_move_the_draw_not_the_logprob():
    # logits log [0.2, 0.3, 0.5], u = 0.6 picks id 2 (cdf 0.5 .. 1.0); a presence penalty of ln 5 on id 2, already
    # in the output, makes the drawn probabilities [0.2, 0.3, 0.1] / 0.6 = [1/3, 1/2, 1/6], cdf [1/3, 5/6, 1]:
    # u = 0.6 now falls on id 1, whose logprob is still the model's log 0.3
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log()
    p = SamplingParams(temperature=1.0, presence_penalty=math.log(5.0))
    (tok,), (lp,) = sample(logits, [p], [0.6], seen=[([0], [2])])
    assert tok == 1 and math.isclose(lp, math.log(0.3), rel_tol=1e-5)
    (tok,), _ = sample(logits, [SamplingParams(temperature=1.0)], [0.6], seen=[([0], [2])])
    assert tok == 2  # unpenalised


def test_min_p_keeps_tokens_near_the_likeliest():
    # probs [0.2, 0.3, 0.5], min_p 0.5: keep p >= 0.25 -> [0, 0.3, 0.5] / 0.8 = [0, 0.375, 0.625]; cdf [0, .375, 1]
    # u = 0.1 falls on id 1 (it would be id 0 without min_p); the logprob stays log 0.3
    logits = torch.tensor([[0.2, 0.3, 0.5]]).log()
    (tok,), (lp,) = sample(logits, [SamplingParams(temperature=1.0, min_p=0.5)], [0.1])
    assert tok == 1 and math.isclose(lp, math.log(0.3), rel_tol=1e-5)


def test_top_logprobs_by_hand():
    # logits log [0.2, 0.3, 0.5] at T = 1: the two likeliest are id 2 (log 0.5) then id 1 (log 0.3); at T = 2 the
    # distribution is softmax(log p / 2) = sqrt(p) / sum sqrt(p): sqrt .5 / (sqrt .2 + sqrt .3 + sqrt .5) = 0.3996
    from relax.engines.native.sampling import top_logprobs

    z = torch.tensor([0.2, 0.3, 0.5]).log()
    (lp2, id2), (lp1, id1) = top_logprobs(z, SamplingParams(top_logprobs_num=2))
    assert (id2, id1) == (2, 1) and math.isclose(lp2, math.log(0.5), rel_tol=1e-5)
    assert math.isclose(lp1, math.log(0.3), rel_tol=1e-5)
    ((lp, i),) = top_logprobs(z, SamplingParams(temperature=2.0, top_logprobs_num=1))
    expected = math.sqrt(0.5) / sum(math.sqrt(p) for p in (0.2, 0.3, 0.5))
    assert i == 2 and math.isclose(lp, math.log(expected), rel_tol=1e-5)
    assert top_logprobs(z, SamplingParams()) is None
