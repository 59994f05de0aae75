"""Off-policy corrections: decoupled PPO, TIS, icepop; values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hand_values import assert_close_to

from relax.algorithms.losses import ppo_loss
from relax.algorithms.off_policy import (
    OFF_POLICY,
    decoupled_ppo_loss,
    decoupled_weights,
    icepop,
    no_correction,
    off_policy_correction,
    tis_weights,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)




def pair(ratios):
    """(target, behaviour) log-probs with pi_target / pi_behav = ratios."""
    target = torch.full((1, len(ratios)), -1.0, dtype=F64)
    return target, target - torch.log(t([ratios]))


ONES = torch.ones(1, 3, dtype=F64)


def test_tis_token():
    # ratios [3, 1, 0.25], cap 2: w = min(r, 2) = [2, 1, 0.25]; one of three truncated
    target, behav = pair([3.0, 1.0, 0.25])
    corr = tis_weights(target, behav, ONES, cap=2.0)
    assert_close_to(corr.weights, [[2.0, 1.0, 0.25]])
    assert_close_to(corr.mask, ONES)
    assert_close_to(corr.metrics["truncated_frac"], 1 / 3)
    assert_close_to(corr.metrics["is_weight_max"], 2.0)


def test_tis_sequence():
    # product 3 * 1 * 0.25 = 0.75 < cap -> 0.75 on every token
    target, behav = pair([3.0, 1.0, 0.25])
    assert_close_to(tis_weights(target, behav, ONES, cap=2.0, level="sequence").weights, [[0.75] * 3])
    # product 3 * 1 * 1 = 3 > cap 2 -> 2 on every token
    target, behav = pair([3.0, 1.0, 1.0])
    assert_close_to(tis_weights(target, behav, ONES, cap=2.0, level="sequence").weights, [[2.0] * 3])


def test_tis_weights_detached_and_overflow_safe():
    target = torch.tensor([[0.0, 0.0, 0.0]], dtype=F64, requires_grad=True)
    behav = t([[-400.0, -400.0, 0.0]])  # sequence log-ratio 800: exp would overflow; min in log space
    corr = tis_weights(target, behav, ONES, cap=2.0, level="sequence")
    assert_close_to(corr.weights, [[2.0] * 3])
    assert not corr.weights.requires_grad


def test_icepop_token():
    # ratios [3, 1, 0.25], bound 2 -> keep 1/2 <= r <= 2: [no, yes, no]
    # weights r * keep = [0, 1, 0], mask [0, 1, 0], kept 1/3
    target, behav = pair([3.0, 1.0, 0.25])
    corr = icepop(target, behav, ONES, cap=2.0)
    assert_close_to(corr.weights, [[0.0, 1.0, 0.0]])
    assert_close_to(corr.mask, [[0.0, 1.0, 0.0]])
    assert_close_to(corr.metrics["kept_frac"], 1 / 3)


def test_icepop_sequence():
    # product 0.75 in [0.5, 2] -> whole sequence kept with weight 0.75
    target, behav = pair([3.0, 1.0, 0.25])
    corr = icepop(target, behav, ONES, cap=2.0, level="sequence")
    assert_close_to(corr.weights, [[0.75] * 3])
    assert_close_to(corr.mask, ONES)
    # product 3 * 1 * 1 = 3 > 2 -> whole sequence dropped
    target, behav = pair([3.0, 1.0, 1.0])
    assert_close_to(icepop(target, behav, ONES, cap=2.0, level="sequence").mask, [[0.0] * 3])


def test_padding_cannot_trip_the_bound():
    # the masked t=2 has an absurd mismatch (ratio e^50); it is neither counted nor kept
    target = t([[-1.0, -1.0, 49.0]])
    behav = t([[-1.0, -1.0, -1.0]])
    mask = t([[1.0, 1.0, 0.0]])
    corr = icepop(target, behav, mask, cap=2.0, level="sequence")
    assert_close_to(corr.mask, [[1.0, 1.0, 0.0]])
    assert_close_to(corr.metrics["kept_frac"], 1.0)


def test_decoupled_weights_and_cap():
    # pi_prox / pi_behav = [1.5, 1, 0.5] -> w = [1.5, 1, 0.5]
    prox, behav = pair([1.5, 1.0, 0.5])
    assert_close_to(decoupled_weights(prox, behav, ONES).weights, [[1.5, 1.0, 0.5]])
    # AReaL cap 1.2: t0 (1.5 > 1.2) dropped: mask [0, 1, 1], w [0, 1, 0.5]
    corr = decoupled_weights(prox, behav, ONES, cap=1.2)
    assert_close_to(corr.mask, [[0.0, 1.0, 1.0]])
    assert_close_to(corr.weights, [[0.0, 1.0, 0.5]])


def test_decoupled_ppo_clips_around_prox_not_behaviour():
    # pi_theta / pi_prox = [1.1, 1.5, 1.0], A = [1, 1, -1], w = pi_prox / pi_behav = [1.5, 1, 0.5]
    # t0: r = 1.1 in [0.8, 1.28] -> -1.1 * 1.5 = -1.65 (behaviour ratio 1.65 alone would clip)
    # t1: r = 1.5 clipped -> -1.28 * 1 = -1.28;  t2: r = 1, A = -1 -> 1 * 0.5 = 0.5
    # grad = -r A w on unclipped tokens: [-1.1 * 1.5, 0, 1 * 0.5] = [-1.65, 0, 0.5]
    prox, behav = pair([1.5, 1.0, 0.5])
    lp = (prox + torch.log(t([[1.1, 1.5, 1.0]]))).requires_grad_(True)
    loss, m = decoupled_ppo_loss(lp, prox, behav, t([[1.0, 1.0, -1.0]]), ONES)
    assert_close_to(loss, [[-1.65, -1.28, 0.5]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[-1.65, 0.0, 0.5]])
    assert_close_to(m["clip_frac"], 1 / 3)
    assert_close_to(m["behav_is_weight_mean"], 1.0)  # (1.5 + 1 + 0.5)/3
    # the same as PPO against pi_prox with the correction's weights
    ref, _ = ppo_loss(lp, prox, t([[1.0, 1.0, -1.0]]), ONES, is_weights=t([[1.5, 1.0, 0.5]]))
    assert_close_to(loss, ref)


def test_no_correction_and_dispatch():
    target, behav = pair([3.0, 1.0, 0.25])
    corr = no_correction(target, behav, ONES)
    assert_close_to(corr.weights, ONES)
    # mismatch k3 = r - 1 - ln r: [2 - 1.098612, 0, -0.75 + 1.386294] = [0.901388, 0, 0.636294]
    assert_close_to(corr.metrics["mismatch_kl"], (0.901388 + 0.636294) / 3)
    for name in OFF_POLICY:
        out = off_policy_correction(name, target, behav, ONES, cap=2.0)
        assert out.weights.shape == (1, 3) and torch.isfinite(out.weights).all()
    assert_close_to(off_policy_correction("tis", target, behav, ONES, cap=2.0).weights, [[2.0, 1.0, 0.25]])
    # decoupled drops w = [3, 1, 0.25] beyond the cap 2 (AReaL's behav_imp_weight_cap): t0 goes
    dropped = off_policy_correction("decoupled", target, behav, ONES, cap=2.0)
    assert_close_to(dropped.mask, [[0.0, 1.0, 1.0]])
    assert_close_to(dropped.weights, [[0.0, 1.0, 0.25]])
    with pytest.raises(ValueError, match="unknown off_policy 'is'; valid: decoupled, icepop, none, recompute, tis"):
        off_policy_correction("is", target, behav, ONES)
    with pytest.raises(ValueError, match="is_cap"):
        tis_weights(target, behav, ONES, cap=0.5)
    with pytest.raises(ValueError, match="level"):
        icepop(target, behav, ONES, level="batch")


def test_bounds_are_symmetric_in_log_space():
    # icepop bound 2 keeps 1/2 <= r <= 2, i.e. |ln r| <= ln 2 = 0.693147:
    # ln r = ln 2 - 1e-9 (kept), -(ln 2 - 1e-9) (kept), ln 2 + 1e-6 (dropped)
    log_r = t([[math.log(2.0) - 1e-9, -(math.log(2.0) - 1e-9), math.log(2.0) + 1e-6]])
    assert_close_to(icepop(log_r, torch.zeros(1, 3, dtype=F64), ONES, cap=2.0).mask, [[1.0, 1.0, 0.0]])
