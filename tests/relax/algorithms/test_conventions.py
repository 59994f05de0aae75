"""The convention options that reproduce verl's choices (docs/algorithms.md, "Matching verl
and slime"), each derived by hand on three-element tensors."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from relax.algorithms import (
    aggregate_loss,
    compute_advantages,
    compute_policy_loss,
    grpo_advantages,
    kl_abs,
    kl_estimate,
    masked_whiten,
    reinforce_pp_advantages,
)
from tests.relax.algorithms.hand_values import assert_close_to


def test_unbiased_whitening_by_hand():
    # x = (1, 2, 3): mu = 2, population var = 2/3, unbiased var = 2/3 * 3/2 = 1
    # unbiased: (x - 2) / sqrt(1 + 1e-8) = (-1, 0, 1); population: (x - 2) / sqrt(2/3) = (-1.2247, 0, 1.2247)
    x, m = torch.tensor([[1.0, 2.0, 3.0]]), torch.ones(1, 3)
    assert_close_to(masked_whiten(x, m, unbiased=True), [[-1.0, 0.0, 1.0]])
    assert_close_to(masked_whiten(x, m), [[-math.sqrt(1.5), 0.0, math.sqrt(1.5)]], atol=1e-6)
    # a masked position neither counts in N nor keeps a value: (1, 3) of (1, 9, 3) -> mu 2, unbiased var 2
    assert_close_to(masked_whiten(torch.tensor([[1.0, 9.0, 3.0]]), torch.tensor([[1.0, 0.0, 1.0]]), unbiased=True),
                    [[-1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)]])


def test_grpo_unbiased_std_by_hand():
    # rewards (1, 0, 0): mean 1/3; unbiased var = ((2/3)^2 + 2 (1/3)^2) / 2 = 1/3, std = 1/sqrt(3)
    # A = (2/3, -1/3, -1/3) * sqrt(3) = (1.1547, -0.5774, -0.5774) (eps 1e-6 moves the 7th digit)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, unbiased=True)
    assert_close_to(adv, [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)], atol=1e-5)
    full, _ = compute_advantages("grpo", torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 1), group_size=3,
                                 unbiased=True)
    assert_close_to(full[:, 0], adv)


def test_reinforce_pp_unbiased_whitening_by_hand():
    # three one-token rows, rewards (1, 0, 0): returns (1, 0, 0), mu 1/3, unbiased var 1/3
    # -> A = (2/3, -1/3, -1/3) * sqrt(3); the population form gives (sqrt 2, -1/sqrt 2, -1/sqrt 2)
    r, m = torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 1)
    assert_close_to(reinforce_pp_advantages(r, m, unbiased=True)[:, 0],
                    [2 / math.sqrt(3), -1 / math.sqrt(3), -1 / math.sqrt(3)])
    assert_close_to(reinforce_pp_advantages(r, m)[:, 0], [math.sqrt(2), -1 / math.sqrt(2), -1 / math.sqrt(2)])


def test_seq_mean_token_sum_by_hand():
    # rows (1, 2, 3) mask (1, 1, 0) and (4, 5, 6) mask (0, 1, 1): sums 3 and 11, mean over 2 rows = 7;
    # no length divisor (seq-mean-token-sum-norm with L_norm 3 gives 7/3)
    loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [0.0, 1.0, 1.0]])
    assert_close_to(aggregate_loss(loss, mask, "seq-mean-token-sum"), 7.0)
    assert_close_to(aggregate_loss(loss, mask, "seq-mean-token-sum-norm", norm_len=3), 7.0 / 3)


def test_abs_kl_by_hand():
    # logp (-1, -2, -3), ref (-2, -2, -1): log rho = ref - logp = (-1, 0, 2) -> |log rho| = (1, 0, 2);
    # d|ref - logp|/dlogp = -sign(ref - logp) = (1, 0, -1)
    lp = torch.tensor([-1.0, -2.0, -3.0], requires_grad=True)
    ref = torch.tensor([-2.0, -2.0, -1.0])
    kl = kl_estimate(lp, ref, "abs")
    assert_close_to(kl, [1.0, 0.0, 2.0])
    kl.sum().backward()
    assert_close_to(lp.grad, [1.0, 0.0, -1.0])
    assert_close_to(kl_abs(lp, ref), kl)


@pytest.mark.parametrize("name", ["gspo", "gspo_token"])
def test_gspo_log_ratio_clamp_by_hand(name):
    # logp = (0, 0, 0), old = (-3, -3, -3): sequence log-ratio 3, A = -1 on all three tokens, clip 0.2/0.28.
    # -min(s A, clip(s) A) = max(s, 1.28) = s: e^3 = 20.09 unclamped; with seq_clamp 1, e^1 = 2.718 and the
    # bound leaves no gradient (verl's clamp at 10 does the same above 10)
    lp = torch.zeros(1, 3, requires_grad=True)
    old, adv, mask = torch.full((1, 3), -3.0), torch.full((1, 3), -1.0), torch.ones(1, 3)
    free, _ = compute_policy_loss(name, lp, old, adv, mask)
    assert_close_to(free, [[math.exp(3)] * 3], atol=1e-4)
    bound, _ = compute_policy_loss(name, lp, old, adv, mask, seq_clamp=1.0)
    assert_close_to(bound, [[math.e] * 3], atol=1e-5)
    bound.sum().backward()
    assert_close_to(lp.grad, [[0.0, 0.0, 0.0]])
    with pytest.raises(ValueError, match="seq_clamp"):
        compute_policy_loss(name, lp, old, adv, mask, seq_clamp=-1.0)


def _verl_set() -> list[str]:
    """The override set docs/algorithms.md gives under "Matching verl and slime"."""
    text = (Path(__file__).parents[3] / "docs" / "algorithms.md").read_text()
    section = text.split("## Matching verl and slime", 1)[1]
    return section.split("```", 2)[1].split()


def test_the_documented_verl_set_is_a_valid_config_that_computes_verls_grpo():
    # the set loads, changes what it names, and its GRPO advantages are verl's (unbiased std + 1e-6):
    # rewards (1, 0, 0) -> (2/3, -1/3, -1/3) / (1/sqrt(3) + 1e-6)
    from relax.config import load_config

    overrides = _verl_set()
    assert "algorithm.std_estimator=unbiased" in overrides and "algorithm.off_policy=recompute" in overrides
    a = load_config(None, overrides).algorithm
    assert (a.std_estimator, a.off_policy, a.policy_loss, a.clip_high) == ("unbiased", "recompute", "dual_clip", 0.2)
    kl = load_config(None, [*overrides, "algorithm.kl_coef=0.001", "algorithm.kl_estimator=k3",
                            "algorithm.kl_clamp=10"]).algorithm
    assert (kl.kl_coef, kl.kl_clamp) == (0.001, 10.0)
    ppo = load_config(None, [*overrides, "algorithm.advantage=gae", "model.value_head=true", "algorithm.lam=1.0",
                             "algorithm.value_clip=0.5"]).algorithm
    assert (ppo.lam, ppo.value_clip) == (1.0, 0.5)
    gspo = load_config(None, [*overrides, "algorithm.policy_loss=gspo_token", "algorithm.gspo_clamp=10"]).algorithm
    assert gspo.gspo_clamp == 10.0
    adv, _ = compute_advantages(a.advantage, torch.tensor([1.0, 0.0, 0.0]), torch.ones(3, 1), group_size=3,
                                unbiased=a.std_estimator == "unbiased")
    std = 1 / math.sqrt(3)
    assert_close_to(adv[:, 0], [(2 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6), (-1 / 3) / (std + 1e-6)])
