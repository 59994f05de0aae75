"""KL in the reward (``kl_in_reward``): token_kl -> compute_advantages, values derived by hand.

Behaviour log-probs are all -1 and the reference is chosen so that
log rho = logp_ref - logp is 0, ln 2 or -ln 2 per token (ln 2 = 0.693147):
k1 = -log rho, k3 = (rho - 1) - log rho = [0, 1 - ln 2, ln 2 - 1/2] = [0, 0.306853, 0.193147].
"""

from __future__ import annotations

import math

import torch
from hand_values import assert_close_to

from relax.algorithms import compute_advantages, token_kl

F64 = torch.float64
LN2 = math.log(2.0)


def test_token_kl_is_zero_off_the_mask_and_detached():
    # k1 = logp - logp_ref = [0, -ln 2, ln 2]; the third token is masked: its huge log-ratio
    # (ref -50 -> k1 = 49) must not reach the reward
    logp = torch.full((1, 3), -1.0, dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0 + LN2, -50.0]], dtype=F64)
    kl = token_kl(logp, ref, torch.tensor([[1, 1, 0]]), "k1")
    assert_close_to(kl, [[0.0, -0.693147, 0.0]])
    assert not kl.requires_grad


def test_gae_token_rewards_carry_minus_beta_kl_per_token():
    # one row of 3 response tokens, outcome r = 1, k3 KL = [0, 0.306853, 0.193147], beta = 0.5:
    # R_t = r * 1[t = last] - beta KL_t = [0, -0.153426, 1 - 0.096574] = [0, -0.153426, 0.903426]
    # V = 0, gamma = lam = 1: A_t = sum_{s >= t} R_s = [0.75, 0.75, 0.903426]; returns = A + V
    logp = torch.full((1, 3), -1.0, dtype=F64)
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]], dtype=F64)
    mask = torch.ones(1, 3, dtype=F64)
    kl = token_kl(logp, ref, mask, "k3")
    assert_close_to(kl, [[0.0, 0.306853, 0.193147]])
    adv, ret = compute_advantages("gae", torch.tensor([1.0], dtype=F64), mask, values=torch.zeros(1, 3, dtype=F64),
                                  token_kl=kl, kl_coef=0.5, gamma=1.0, lam=1.0)
    assert_close_to(adv, [[0.75, 0.75, 0.903426]])
    assert_close_to(ret, [[0.75, 0.75, 0.903426]])


def test_reinforce_pp_whitens_the_kl_shaped_returns():
    # three rows of one token each, rewards (1, 0, 0), k1 KL = (0, -ln 2, ln 2), beta = 1:
    # R = r - KL = (1, ln 2, -ln 2) = (1, 0.693147, -0.693147); gamma = 1, one token: G = R
    # batch mean 1/3, population var ((2/3)^2 + 0.359814^2 + 1.026480^2) / 3 = 0.542524
    # A = (G - 1/3) / sqrt(0.542524) = (0.905105, 0.488504, -1.393610)
    logp = torch.full((3, 1), -1.0, dtype=F64)
    ref = torch.tensor([[-1.0], [-1.0 + LN2], [-1.0 - LN2]], dtype=F64)
    mask = torch.ones(3, 1, dtype=F64)
    kl = token_kl(logp, ref, mask, "k1")
    adv, ret = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0, 0.0], dtype=F64), mask,
                                  token_kl=kl, kl_coef=1.0)
    assert_close_to(adv, [[0.905105], [0.488504], [-1.393610]])
    assert ret is None


def test_group_estimator_subtracts_the_summed_penalty_before_the_baseline():
    # drgrpo, one group of three rows, rewards (1, 0, 0), beta = 0.5, k1:
    # row 0: log rho (0, ln 2, -ln 2) -> KL (0, -ln 2, ln 2), sum 0
    # row 1: log rho (-ln 2, -ln 2, masked) -> KL (ln 2, ln 2, 0), sum 2 ln 2
    # row 2: first token masked (ref -7 ignored), log rho (0, 0) -> sum 0
    # r' = r - beta sum_t KL = (1, -ln 2, 0) = (1, -0.693147, 0); mean 0.102284
    # A = r' - mean = (0.897716, -0.795431, -0.102284), on each row's masked tokens
    logp = torch.full((3, 3), -1.0, dtype=F64)
    ref = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2], [-1.0 - LN2, -1.0 - LN2, -1.0], [-7.0, -1.0, -1.0]],
                       dtype=F64)
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 1, 1]], dtype=F64)
    kl = token_kl(logp, ref, mask, "k1")
    adv, _ = compute_advantages("drgrpo", torch.tensor([1.0, 0.0, 0.0], dtype=F64), mask, group_size=3,
                                token_kl=kl, kl_coef=0.5)
    assert_close_to(adv, [[0.897716] * 3, [-0.795431, -0.795431, 0.0], [0.0, -0.102284, -0.102284]])
    # without the KL the same group is r - mean = (2/3, -1/3, -1/3): the penalty changed every row
    plain, _ = compute_advantages("drgrpo", torch.tensor([1.0, 0.0, 0.0], dtype=F64), mask, group_size=3)
    assert_close_to(plain[:, 1], [0.666667, -0.333333, -0.333333])
