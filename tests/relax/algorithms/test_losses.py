"""Policy losses on three tokens with values and gradients derived by hand.

Sign convention: losses are MINIMISED, so a token with positive advantage has negative
loss and a negative gradient w.r.t. its log-prob (gradient descent raises the log-prob).
"""

from __future__ import annotations

import math

import pytest
import torch
from hand_values import assert_close_to

from relax.algorithms.aggregation import seq_mean_token_mean
from relax.algorithms.losses import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    dual_clip_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_loss,
)

F64 = torch.float64


def t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)




def logprobs_with_ratios(ratios, old=-1.0):
    """New log-probs such that pi_new / pi_old = ratios, old log-probs all ``old``."""
    old_lp = torch.full((1, len(ratios)), old, dtype=F64)
    new_lp = (old_lp + torch.log(t([ratios]))).requires_grad_(True)
    return new_lp, old_lp


def test_ppo_asymmetric_clip():
    # ratios r = [1.5, 0.5, 1.1], A = [1, -1, -2], eps_low 0.2, eps_high 0.28 -> clip to [0.8, 1.28]
    # t0: rA = 1.5, clip(r)A = 1.28 -> min 1.28 -> loss -1.28 (clipped high, grad 0)
    # t1: rA = -0.5, clip(r)A = -0.8 -> min -0.8 -> loss 0.8 (clipped low, grad 0)
    # t2: rA = -2.2, clip(r)A = -2.2 -> loss 2.2, grad d(-rA)/dlogp = -rA = 2.2
    lp, old = logprobs_with_ratios([1.5, 0.5, 1.1])
    loss, m = ppo_loss(lp, old, t([[1.0, -1.0, -2.0]]), torch.ones(1, 3), clip_low=0.2, clip_high=0.28)
    assert_close_to(loss, [[-1.28, 0.8, 2.2]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[0.0, 0.0, 2.2]])
    assert_close_to(m["clip_frac"], 2 / 3)
    assert_close_to(m["clip_frac_low"], 1 / 3)
    assert_close_to(m["clip_frac_high"], 1 / 3)
    # k3(old -> new) = r - 1 - log r: [0.5 - 0.405465, -0.5 + 0.693147, 0.1 - 0.095310]
    # = [0.094535, 0.193147, 0.004690], mean 0.097457
    assert_close_to(m["approx_kl"], 0.097457)
    assert_close_to(m["ratio_mean"], (1.5 + 0.5 + 1.1) / 3)


def test_ppo_pessimistic_side_is_not_clipped():
    # r = 0.5 with A = +1: rA = 0.5 < clip(r)A = 0.8 -> min picks the unclipped 0.5
    # loss -0.5, grad -rA = -0.5 (the clip never shields a token that got worse)
    # r = 2.0 with A = -1: rA = -2 < -1.28 -> loss 2, grad 2;  r = 1 with A = 0: loss 0
    lp, old = logprobs_with_ratios([0.5, 2.0, 1.0])
    loss, m = ppo_loss(lp, old, t([[1.0, -1.0, 0.0]]), torch.ones(1, 3))
    assert_close_to(loss, [[-0.5, 2.0, 0.0]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[-0.5, 2.0, 0.0]])
    assert_close_to(m["clip_frac"], 0.0)


def test_ppo_is_weights_and_mask():
    # same tokens as test_ppo_asymmetric_clip, w = [2, 0.5, 3], mask [1, 1, 0]
    # loss = [-1.28 * 2, 0.8 * 0.5, 0 (masked)] = [-2.56, 0.4, 0]; only t2 had a gradient,
    # and it is masked -> grad all 0
    lp, old = logprobs_with_ratios([1.5, 0.5, 1.1])
    loss, _ = ppo_loss(lp, old, t([[1.0, -1.0, -2.0]]), t([[1.0, 1.0, 0.0]]), is_weights=t([[2.0, 0.5, 3.0]]))
    assert_close_to(loss, [[-2.56, 0.4, 0.0]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[0.0, 0.0, 0.0]])


def test_masked_nan_does_not_leak():
    # padding at t=1 holds NaN in every input: the loss there is 0, grads and metrics finite
    nan = float("nan")
    lp = t([[-1.0, nan, -0.5]]).requires_grad_(True)
    for name in POLICY_LOSSES:
        lp.grad = None
        loss, metrics = compute_policy_loss(name, lp, t([[-1.0, nan, -0.5]]), t([[1.0, nan, 1.0]]),
                                            t([[1.0, 0.0, 1.0]]), is_weights=t([[1.0, nan, 1.0]]))
        assert loss[0, 1] == 0, name
        assert torch.isfinite(loss).all(), name
        loss.sum().backward()
        assert torch.isfinite(lp.grad).all(), name
        assert all(torch.isfinite(v) for v in metrics.values()), name


def test_dual_clip_bounds_negative_advantage():
    # c = 3, clip [0.8, 1.28]
    # t0: r = 5, A = -1: PPO loss max(5, 1.28) = 5; bound -cA = 3 -> min(5, 3) = 3, grad 0
    # t1: r = 2, A = -1: PPO loss 2 < 3 -> 2, grad -rA = 2
    # t2: r = 5, A = +1: A >= 0, plain PPO: -min(5, 1.28) = -1.28, grad 0
    lp, old = logprobs_with_ratios([5.0, 2.0, 5.0])
    loss, m = dual_clip_loss(lp, old, t([[-1.0, -1.0, 1.0]]), torch.ones(1, 3), dual_clip_c=3.0)
    assert_close_to(loss, [[3.0, 2.0, -1.28]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[0.0, 2.0, 0.0]])
    assert_close_to(m["dual_clip_frac"], 1 / 3)
    assert_close_to(m["clip_frac"], 2 / 3)  # t0 (dual) and t2 (high)


def test_dual_clip_rejects_c_not_above_one():
    lp, old = logprobs_with_ratios([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="dual_clip_c"):
        dual_clip_loss(lp, old, t([[1.0, 1.0, 1.0]]), torch.ones(1, 3), dual_clip_c=1.0)


def test_gspo_sequence_ratio():
    # log-ratios [0.3, -0.1, 0.1]: mean 0.1 -> s = e^0.1 = 1.105171 (inside [0.8, 1.28])
    # A = 1 on every token -> L = -s A = -1.105171, carried by each of the 3 tokens
    # seq-mean-token-mean: J = (1/3) * 3 * (-s) = -s; dJ/dlogp_t = -s * (1/3) = -0.368390
    old = torch.full((1, 3), -1.0, dtype=F64)
    lp = (old + t([[0.3, -0.1, 0.1]])).requires_grad_(True)
    mask = torch.ones(1, 3)
    loss, m = gspo_loss(lp, old, t([[1.0, 1.0, 1.0]]), mask)
    s = math.exp(0.1)
    assert_close_to(loss, [[-s, -s, -s]])
    seq_mean_token_mean(loss, mask).backward()
    assert_close_to(lp.grad, [[-s / 3] * 3])
    assert_close_to(m["clip_frac"], 0.0)


def test_gspo_clipped_sequence_and_masked_token():
    # log-ratios [0.5, 0.5, 9.0], mask [1, 1, 0]: mean over response tokens 0.5
    # s = e^0.5 = 1.648721 > 1.28, A = 1 -> L = -1.28 on the 2 response tokens, grad 0
    old = torch.full((1, 3), -1.0, dtype=F64)
    lp = (old + t([[0.5, 0.5, 9.0]])).requires_grad_(True)
    loss, m = gspo_loss(lp, old, t([[1.0, 1.0, 1.0]]), t([[1.0, 1.0, 0.0]]))
    assert_close_to(loss, [[-1.28, -1.28, 0.0]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[0.0, 0.0, 0.0]])
    assert_close_to(m["clip_frac"], 1.0)


def test_gspo_token_per_token_advantages():
    # log-ratios [0.3, -0.1, 0.1] -> s = e^0.1 = 1.105171 (in range); A = [1, -1, 2]
    # s_it = sg[s] * pi/sg[pi] has value s and d s_it / d logp_t = s
    # l_t = -s A_t = [-1.105171, 1.105171, -2.210342]; d(sum l)/d logp_t = -s A_t (same numbers)
    old = torch.full((1, 3), -1.0, dtype=F64)
    lp = (old + t([[0.3, -0.1, 0.1]])).requires_grad_(True)
    loss, _ = gspo_token_loss(lp, old, t([[1.0, -1.0, 2.0]]), torch.ones(1, 3))
    s = math.exp(0.1)
    assert_close_to(loss, [[-s, s, -2 * s]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[-s, s, -2 * s]])


def test_gspo_token_matches_gspo_gradient_for_sequence_advantages():
    # with A constant per sequence and seq-mean-token-mean, both variants give -s A / |y| per token
    old = torch.full((1, 3), -1.0, dtype=F64)
    grads = []
    for fn in (gspo_loss, gspo_token_loss):
        lp = (old + t([[0.3, -0.1, 0.1]])).requires_grad_(True)
        loss, _ = fn(lp, old, t([[0.7, 0.7, 0.7]]), torch.ones(1, 3))
        seq_mean_token_mean(loss, torch.ones(1, 3)).backward()
        grads.append(lp.grad)
    assert_close_to(grads[0], grads[1])


def test_cispo_clipped_weight_keeps_gradient():
    # r = [1.5, 0.5, 1.1] -> sg[clip(r, 0.8, 1.28)] = [1.28, 0.8, 1.1]; A = [1, -1, 2]
    # logp = [-0.5, -2, -1]; l = -w A logp:
    # t0: -(1.28)(1)(-0.5) = 0.64; t1: -(0.8)(-1)(-2) = -1.6; t2: -(1.1)(2)(-1) = 2.2
    # grad = -w A = [-1.28, 0.8, -2.2] -- clipped tokens t0, t1 still get a gradient
    lp = t([[-0.5, -2.0, -1.0]]).requires_grad_(True)
    old = lp.detach() - torch.log(t([[1.5, 0.5, 1.1]]))
    loss, m = cispo_loss(lp, old, t([[1.0, -1.0, 2.0]]), torch.ones(1, 3))
    assert_close_to(loss, [[0.64, -1.6, 2.2]])
    loss.sum().backward()
    assert_close_to(lp.grad, [[-1.28, 0.8, -2.2]])
    assert_close_to(m["clip_frac"], 2 / 3)


def test_clip_arguments_validated():
    lp, old = logprobs_with_ratios([1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="clip_low"):
        ppo_loss(lp, old, t([[1.0, 1.0, 1.0]]), torch.ones(1, 3), clip_low=1.5)
    with pytest.raises(ValueError, match="clip_high"):
        ppo_loss(lp, old, t([[1.0, 1.0, 1.0]]), torch.ones(1, 3), clip_high=-0.1)
    # clip_low = 1 (no lower bound, as CISPO uses it) is accepted: r = 0.5 -> weight 0.5, not 0.8
    lp2 = t([[-1.0]]).requires_grad_(True)
    loss, _ = cispo_loss(lp2, lp2.detach() - math.log(0.5), t([[1.0]]), torch.ones(1, 1), clip_low=1.0)
    assert_close_to(loss, [[-0.5 * 1.0 * -1.0]])  # -w A logp = -(0.5)(1)(-1) = 0.5


def test_compute_policy_loss_dispatch():
    lp, old = logprobs_with_ratios([5.0, 2.0, 5.0])
    adv = t([[-1.0, -1.0, 1.0]])
    direct, _ = dual_clip_loss(lp, old, adv, torch.ones(1, 3), dual_clip_c=4.0)
    via, _ = compute_policy_loss("dual_clip", lp, old, adv, torch.ones(1, 3), dual_clip_c=4.0)
    assert_close_to(via, direct)  # t0: min(5, 4) = 4 -> the knob reached the loss
    assert_close_to(via[0, 0], 4.0)
    with pytest.raises(ValueError, match="unknown policy_loss 'pg'; valid: cispo, dual_clip, gspo, gspo_token, ppo"):
        compute_policy_loss("pg", lp, old, adv, torch.ones(1, 3))
