"""Advantage estimators against values derived by hand.

Std flavour: population std (divide by G) unless a test says otherwise -- it is what
relax.algorithms uses, because it is defined for G = 1 and gives exactly +-1 for a
two-sample group with different rewards.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
from hand_values import assert_close_to

from relax.algorithms.advantages import (
    broadcast_to_tokens,
    compute_advantages,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    stuck_group_push,
    stuck_groups,
)

# float32 estimators: hand values to 6 decimals are within 1e-5
assert_close_within_1e5 = functools.partial(assert_close_to, atol=1e-5)


def test_grpo_three_rewards_population_std():
    # rewards [1, 0, 1]: mean 2/3, deviations [1/3, -2/3, 1/3]
    # population var = (1/9 + 4/9 + 1/9) / 3 = 2/9, std = sqrt(2/9) = 0.471405
    # -> [0.3333/0.4714, -0.6667/0.4714, 0.3333/0.4714] = [0.707107, -1.414214, 0.707107]
    assert_close_within_1e5(
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=3), [0.707107, -1.414214, 0.707107]
    )


def test_grpo_sample_std_option():
    # same rewards, sample var = (6/9) / (3 - 1) = 1/3, std = 0.577350
    # -> [0.3333/0.5774, -0.6667/0.5774, ...] = [0.577350, -1.154701, 0.577350]
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=3, unbiased=True)
    assert_close_within_1e5(adv, [0.577350, -1.154701, 0.577350])


def test_grpo_groups_are_contiguous_and_all_equal_group_is_zero():
    # group 1 = [1, 0, 1] as above; group 2 = [0.1, 0.1, 0.1]: all equal -> exactly 0, even
    # though float mean(0.1, 0.1, 0.1) need not equal 0.1 bit for bit.
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.1, 0.1, 0.1])
    adv = grpo_advantages(rewards, group_size=3)
    assert_close_within_1e5(adv[:3], [0.707107, -1.414214, 0.707107])
    assert torch.equal(adv[3:], torch.zeros(3))


@pytest.mark.parametrize("eps", [0.0, 1e-6])
def test_grpo_all_equal_no_nan_even_without_eps(eps):
    # std = 0 and centred = 0: 0 / (0 + 0) would be NaN; the estimator must give 0.
    adv = grpo_advantages(torch.tensor([1.0, 1.0, 1.0]), group_size=3, eps=eps)
    assert torch.equal(adv, torch.zeros(3))


def test_grpo_group_of_one_is_zero():
    # G = 1: r - mean = 0, population std = 0 -> 0 (a sample std would be undefined).
    assert torch.equal(grpo_advantages(torch.tensor([3.0, -1.0, 0.5]), group_size=1), torch.zeros(3))


def test_grpo_eps_matters_for_tiny_spread():
    # rewards [1e-6, 0]: mean 5e-7, population std 5e-7, deviations +-5e-7
    # eps = 1e-6: 5e-7 / (5e-7 + 1e-6) = 1/3 (eps damps near-ties); eps = 0: exactly +-1
    rewards = torch.tensor([1e-6, 0.0], dtype=torch.float64)
    assert_close_within_1e5(grpo_advantages(rewards, 2, eps=1e-6), [1 / 3, -1 / 3], atol=1e-9)
    assert_close_within_1e5(grpo_advantages(rewards, 2, eps=0.0), [1.0, -1.0], atol=1e-9)


def test_drgrpo_three_rewards():
    # rewards [1, 0, 1], mean 2/3, no std division -> [1/3, -2/3, 1/3]
    assert_close_within_1e5(drgrpo_advantages(torch.tensor([1.0, 0.0, 1.0]), 3), [1 / 3, -2 / 3, 1 / 3])


def test_rloo_three_rewards():
    # i=0: 1 - (0 + 1)/2 = 0.5; i=1: 0 - (1 + 1)/2 = -1; i=2: 1 - (1 + 0)/2 = 0.5
    # (= G/(G-1) * drgrpo = 1.5 * [1/3, -2/3, 1/3])
    assert_close_within_1e5(rloo_advantages(torch.tensor([1.0, 0.0, 1.0]), 3), [0.5, -1.0, 0.5])


def test_stuck_group_push_three_groups_of_three():
    # groups [0, 0, 0] (all wrong), [0.5, 0.5, 0.5] (all near misses), [1, 0, 1] (mixed); beta 0.2:
    # all wrong -> -0.2 * (1 - 0) = -0.2 each; near misses -> -0.2 * (1 - 0.5) = -0.1 each;
    # a mixed group is GRPO's to judge -> 0
    rewards = torch.tensor([0.0, 0.0, 0.0, 0.5, 0.5, 0.5, 1.0, 0.0, 1.0])
    assert_close_within_1e5(stuck_group_push(rewards, 3, 0.2), [-0.2] * 3 + [-0.1] * 3 + [0.0] * 3)
    # an all-right group [1, 1, 1] is not stuck: 0
    assert_close_within_1e5(stuck_group_push(torch.tensor([1.0, 1.0, 1.0]), 3, 0.2), [0.0, 0.0, 0.0])
    assert stuck_groups(rewards, 3).tolist() == [True, True, False]
    assert stuck_groups(torch.tensor([1.0, 1.0, 1.0]), 3).tolist() == [False]


def test_compute_advantages_adds_stuck_push_to_group_estimators():
    # groups [0, 0, 0] and [1, 0, 1], beta 0.5: GRPO gives [0, 0, 0] and [0.707107, -1.414214, 0.707107];
    # the push adds -0.5 * (1 - 0) = -0.5 to the first group only
    rewards, mask = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0, 1.0]), torch.ones(6, 2)
    adv, _ = compute_advantages("grpo", rewards, mask, group_size=3, stuck_push=0.5)
    assert_close_within_1e5(adv[:, 0], [-0.5, -0.5, -0.5, 0.707107, -1.414214, 0.707107])
    assert torch.equal(adv[:, 0], adv[:, 1])  # every response token carries its sequence's advantage
    # judged on outcome rewards: a KL penalty that makes the all-wrong group's totals differ changes nothing
    kl = torch.tensor([[0.1, 0.0], [0.0, 0.0], [0.2, 0.2]] + [[0.0, 0.0]] * 3)
    adv_kl, _ = compute_advantages("drgrpo", rewards, mask, group_size=3, token_kl=kl, kl_coef=1.0, stuck_push=0.5)
    # drgrpo of totals [-0.1, 0, -0.4] (mean -1/6): [1/15, 1/6, -7/30], plus -0.5 each
    assert_close_within_1e5(adv_kl[:3, 0], [1 / 15 - 0.5, 1 / 6 - 0.5, -7 / 30 - 0.5])
    with pytest.raises(ValueError, match="group estimators"):
        compute_advantages("reinforce_pp", rewards, mask, group_size=3, stuck_push=0.5)


def test_integer_and_bool_rewards_are_promoted():
    # verifier rewards as ints [1, 0, 1] -> the same float advantages as above
    assert_close_within_1e5(grpo_advantages(torch.tensor([1, 0, 1]), 3), [0.707107, -1.414214, 0.707107])
    adv, _ = compute_advantages("reinforce_pp", torch.tensor([True, False, True]), torch.ones(3, 1))
    assert_close_within_1e5(adv, [[0.707107], [-1.414214], [0.707107]])


def test_group_layout_errors():
    with pytest.raises(ValueError, match="group_size"):
        grpo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=2)
    with pytest.raises(ValueError, match="rloo needs"):
        rloo_advantages(torch.tensor([1.0, 0.0, 1.0]), group_size=1)
    with pytest.raises(ValueError, match="1-D"):
        drgrpo_advantages(torch.ones(3, 1), group_size=3)


def test_broadcast_and_outcome_placement():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    # A_it = A_i * m_it
    assert_close_within_1e5(
        broadcast_to_tokens(torch.tensor([2.0, -1.0, 5.0]), mask), [[2, 2, 0], [-1, 0, -1], [0, 0, 0]]
    )
    # reward on the last response token: row 0 -> t=1, row 1 (hole at t=1) -> t=2, row 2 empty -> none
    assert_close_within_1e5(
        outcome_to_token_rewards(torch.tensor([1.0, 2.0, 3.0]), mask), [[0, 1, 0], [0, 0, 2], [0, 0, 0]]
    )


def test_reinforce_pp_batch_whitening():
    # rewards [1, 0, 1], lengths 2, 1, 0, gamma 1: returns row0 [1, 1], row1 [0], row2 none
    # valid tokens [1, 1, 0]: mean 2/3, population var 2/9 -> (x - 2/3) / 0.4714
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0]), mask)
    assert_close_within_1e5(adv, [[0.707107, 0.707107, 0.0], [-1.414214, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_reinforce_pp_kl_folded_into_token_rewards():
    # one sequence, r = 1, KL = [0.1, 0.2, 0.3], beta = 1, gamma = 1
    # token rewards [-0.1, -0.2, 1 - 0.3] = [-0.1, -0.2, 0.7]; returns [0.4, 0.5, 0.7]
    # mean 1.6/3 = 8/15; deviations [-4, -1, 5]/30; var = (16 + 1 + 25)/900/3 = 14/900
    # std = sqrt(14)/30 -> A = [-4, -1, 5] / sqrt(14) = [-1.069045, -0.267261, 1.336306]
    adv = reinforce_pp_advantages(
        torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
        token_kl=torch.tensor([[0.1, 0.2, 0.3]], dtype=torch.float64), kl_coef=1.0,
    )
    assert_close_within_1e5(adv, [[-4 / math.sqrt(14), -1 / math.sqrt(14), 5 / math.sqrt(14)]], atol=1e-9)


def test_reinforce_pp_discount():
    # r = 1 on t=2, gamma 0.5: returns [0.25, 0.5, 1]; mean 7/12; deviations [-4, -1, 5]/12
    # -> the same shape as above: [-4, -1, 5] / sqrt(14)
    adv = reinforce_pp_advantages(torch.tensor([1.0], dtype=torch.float64), torch.ones(1, 3, dtype=torch.float64),
                                  gamma=0.5)
    assert_close_within_1e5(adv, [[-4 / math.sqrt(14), -1 / math.sqrt(14), 5 / math.sqrt(14)]], atol=1e-9)


def test_reinforce_pp_baseline_group_mean_then_batch_std():
    # rewards [1, 0, 1] (one group of 3): group-centred [1/3, -2/3, 1/3]
    # lengths 2, 1, 2 -> tokens [1/3, 1/3 | -2/3 | 1/3, 1/3]: mean (4/3 - 2/3)/5 = 2/15
    # deviations 1/3 - 2/15 = 0.2 and -2/3 - 2/15 = -0.8; var = (4 * 0.04 + 0.64)/5 = 0.16
    # std 0.4 -> [0.5, 0.5 | -2 | 0.5, 0.5]
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv = reinforce_pp_baseline_advantages(torch.tensor([1.0, 0.0, 1.0]), mask, group_size=3)
    assert_close_within_1e5(adv, [[0.5, 0.5], [-2.0, 0.0], [0.5, 0.5]])


def test_reinforce_pp_empty_batch_no_nan():
    adv = reinforce_pp_advantages(torch.tensor([1.0, 0.0, 1.0]), torch.zeros(3, 4))
    assert torch.equal(adv, torch.zeros(3, 4))


def test_gae_hand_computed():
    # R = [0, 0, 1], V = [0.5, 0.6, 0.7], gamma 1, lam 0.5, V after the end = 0
    # delta_2 = 1 - 0.7 = 0.3              A_2 = 0.3
    # delta_1 = 0 + 0.7 - 0.6 = 0.1        A_1 = 0.1 + 0.5 * 0.3 = 0.25
    # delta_0 = 0 + 0.6 - 0.5 = 0.1        A_0 = 0.1 + 0.5 * 0.25 = 0.225
    # returns = A + V = [0.725, 0.85, 1.0]
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                              torch.ones(1, 3), gamma=1.0, lam=0.5)
    assert_close_within_1e5(adv, [[0.225, 0.25, 0.3]])
    assert_close_within_1e5(ret, [[0.725, 0.85, 1.0]])


def test_gae_lambda_one_is_monte_carlo_return():
    # gamma 0.9, lam 1: delta = [0.9*0.6 - 0.5, 0.9*0.7 - 0.6, 1 - 0.7] = [0.04, 0.03, 0.3]
    # A_2 = 0.3, A_1 = 0.03 + 0.9*0.3 = 0.3, A_0 = 0.04 + 0.9*0.3 = 0.31
    # returns = [0.81, 0.9, 1.0] = [0.9^2, 0.9, 1] (the discounted outcome)
    adv, ret = gae_advantages(torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
                              torch.ones(1, 3), gamma=0.9, lam=1.0)
    assert_close_within_1e5(adv, [[0.31, 0.3, 0.3]])
    assert_close_within_1e5(ret, [[0.81, 0.9, 1.0]])


def test_gae_skips_masked_tokens():
    # mask [1, 0, 1] (t=1 is a tool observation: its value 9.9 and reward 5 are ignored)
    # t=2: delta = 1 - 0.7 = 0.3, A = 0.3; t=0: next response token is t=2:
    # delta = 0 + 0.7 - 0.5 = 0.2, A_0 = 0.2 + 1 * 0.5 * 0.3 = 0.35; returns [0.85, 0, 1.0]
    adv, ret = gae_advantages(torch.tensor([[0.0, 5.0, 1.0]]), torch.tensor([[0.5, 9.9, 0.7]]),
                              torch.tensor([[1.0, 0.0, 1.0]]), gamma=1.0, lam=0.5)
    assert_close_within_1e5(adv, [[0.35, 0.0, 0.3]])
    assert_close_within_1e5(ret, [[0.85, 0.0, 1.0]])


def test_compute_advantages_kl_in_reward_for_group_estimator():
    # sequence reward r_i - beta * sum_t KL_it: [1 - 0.2, 0 - 0, 1 - 0.6] = [0.8, 0, 0.4]
    # GRPO: mean 0.4, deviations [0.4, -0.4, 0], population var 0.32/3, std 0.326599
    # -> [1.224745, -1.224745, 0] (= +-sqrt(1.5)), broadcast over 2 tokens
    mask = torch.ones(3, 2)
    kl = torch.tensor([[0.1, 0.1], [0.0, 0.0], [0.3, 0.3]])
    adv, ret = compute_advantages("grpo", torch.tensor([1.0, 0.0, 1.0]), mask, group_size=3,
                                  token_kl=kl, kl_coef=1.0)
    assert_close_within_1e5(adv, [[1.224745] * 2, [-1.224745] * 2, [0.0, 0.0]])
    assert ret is None


@pytest.mark.parametrize("name", ["grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"])
def test_compute_advantages_every_name(name):
    rewards = torch.tensor([1.0, 0.0, 1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    adv, ret = compute_advantages(name, rewards, mask, group_size=3, values=torch.zeros(3, 2))
    assert adv.shape == (3, 2) and torch.isfinite(adv).all()
    assert adv[1, 1] == 0  # off the mask
    assert (ret is not None) == (name == "gae")


def test_compute_advantages_errors():
    with pytest.raises(ValueError, match="unknown advantage 'ppo'; valid: drgrpo, gae, grpo"):
        compute_advantages("ppo", torch.zeros(3), torch.ones(3, 1))
    with pytest.raises(ValueError, match="needs values"):
        compute_advantages("gae", torch.zeros(3), torch.ones(3, 1))
