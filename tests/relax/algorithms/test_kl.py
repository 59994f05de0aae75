"""KL estimators, KL as loss / reward, entropy: values derived by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hand_values import assert_close_to

from relax.algorithms.kl import (
    entropy_bonus,
    entropy_from_logits,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_reward_penalty,
    token_kl,
    topk_forward_kl,
)

F64 = torch.float64
LN2 = math.log(2.0)
# policy log-probs all -1; reference chosen so log rho = log p_ref - log q = [0, ln 2, -ln 2]
LOGP = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
REF = torch.tensor([[-1.0, -1.0 + LN2, -1.0 - LN2]], dtype=F64)




def test_k1():
    # k1 = -log rho = [0, -ln 2, ln 2] = [0, -0.693147, 0.693147] (negative per token is allowed)
    assert_close_to(kl_k1(LOGP, REF), [[0.0, -0.693147, 0.693147]])


def test_k2():
    # k2 = (log rho)^2 / 2 = [0, 0.480453/2, 0.480453/2] = [0, 0.240227, 0.240227]
    assert_close_to(kl_k2(LOGP, REF), [[0.0, 0.240227, 0.240227]])


def test_k3():
    # k3 = (rho - 1) - log rho, rho = [1, 2, 0.5]:
    # [0, 1 - 0.693147, -0.5 + 0.693147] = [0, 0.306853, 0.193147] (always >= 0)
    assert_close_to(kl_k3(LOGP, REF), [[0.0, 0.306853, 0.193147]])


def test_k1_and_k3_are_unbiased_exactly():
    # over a 3-outcome support the expectation is an exact sum: E_q[k] = sum_x q(x) k(x)
    # q = [0.5, 0.3, 0.2], p = [0.2, 0.3, 0.5]; KL[q||p] = sum q log(q/p)
    # = 0.5 ln 2.5 + 0 + 0.2 ln 0.4 = 0.458145 - 0.183258 = 0.274887
    q = torch.tensor([[0.5, 0.3, 0.2]], dtype=F64)
    p = torch.tensor([[0.2, 0.3, 0.5]], dtype=F64)
    for name in ("k1", "k3"):
        expectation = (q * kl_estimate(q.log(), p.log(), name)).sum()
        assert_close_to(expectation, 0.274887)
    # k2 is biased: E_q[(log rho)^2 / 2] = 0.5 (0.5 * 0.839589 + 0.2 * 0.839589) = 0.293856
    assert_close_to((q * kl_estimate(q.log(), p.log(), "k2")).sum(), 0.293856)


def test_kl_loss_masks_and_differentiates_policy_only():
    logp = LOGP.clone().requires_grad_(True)
    ref = REF.clone().requires_grad_(True)
    loss = kl_loss(logp, ref, torch.tensor([[1.0, 1.0, 0.0]]), "k3")
    assert_close_to(loss, [[0.0, 0.306853, 0.0]])
    loss.sum().backward()
    # d k3 / d logp = d/dlogp [exp(ref - logp) - 1 - (ref - logp)] = 1 - rho = [0, -1, (masked)]
    assert_close_to(logp.grad, [[0.0, -1.0, 0.0]])
    assert ref.grad is None


def test_kl_reward_penalty_sign_and_no_grad():
    # -beta * k1 with beta = 0.1: -0.1 * [0, -0.693147, 0.693147] = [0, 0.069315, -0.069315]
    logp = LOGP.clone().requires_grad_(True)
    pen = kl_reward_penalty(logp, REF, torch.ones(1, 3), kl_coef=0.1, estimator="k1")
    assert_close_to(pen, [[0.0, 0.069315, -0.069315]])
    assert not pen.requires_grad
    # k3 penalty is never positive: -0.1 * [0, 0.306853, 0.193147]
    assert_close_to(kl_reward_penalty(LOGP, REF, torch.ones(1, 3), 0.1, "k3"), [[0.0, -0.030685, -0.019315]])


def test_kl_extreme_ratio_finite():
    out = kl_k3(torch.tensor([[-200.0, 0.0]]), torch.tensor([[0.0, -200.0]]))
    assert torch.isfinite(out).all()


def test_kl_clamp_bounds_the_estimate_and_drops_the_gradient_beyond_it():
    # log rho = ref - logp = [0, 1, 16]: k3 = rho - 1 - log rho = [0, e - 2, e^16 - 17]
    # = [0, 0.718282, 8886093.5]; clamped at 10 -> [0, 0.718282, 10].
    # d k3 / d logp = 1 - rho = [0, 1 - e, 1 - e^16] = [0, -1.718282, -8886109.5] unclamped;
    # the clamp zeroes the third, so one avoided token no longer outweighs the batch by 5e6
    logp = torch.tensor([[-1.0, -2.0, -17.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.0, -1.0, -1.0]], dtype=F64)
    raw = kl_estimate(logp, ref, "k3")
    assert_close_to(raw[0, :2], [0.0, 0.718282])
    assert raw[0, 2].item() == pytest.approx(math.exp(16) - 17, rel=1e-9)
    clamped = kl_loss(logp, ref, torch.ones(1, 3), "k3", clamp=10.0)
    assert_close_to(clamped, [[0.0, 0.718282, 10.0]])
    clamped.sum().backward()
    assert_close_to(logp.grad, [[0.0, -1.718282, 0.0]])
    # k1 can be negative per token, so the bound is symmetric: -log rho = [0, -1, -16] -> [0, -1, -10]
    assert_close_to(kl_estimate(logp, ref, "k1", clamp=10.0), [[0.0, -1.0, -10.0]])
    # the reward path bounds its penalty the same way (no gradient there anyway)
    assert_close_to(token_kl(logp, ref, torch.ones(1, 3), "k3", clamp=10.0), [[0.0, 0.718282, 10.0]])


def test_unknown_estimator():
    with pytest.raises(ValueError, match="unknown kl_estimator 'k4'; valid: abs, k1, k2, k3"):
        kl_estimate(LOGP, REF, "k4")


def test_entropy_hand_values():
    # uniform over 3: ln 3 = 1.098612
    # logits log [1, 2, 1] -> p = [0.25, 0.5, 0.25]: H = 2 * 0.25 * ln 4 + 0.5 * ln 2
    # = 0.693147 + 0.346574 = 1.039721
    # huge logits [1000, 1000, -1000]: two-way uniform, ln 2 = 0.693147 (no overflow)
    logits = torch.tensor([[[0.0, 0.0, 0.0], [0.0, LN2, 0.0], [1000.0, 1000.0, -1000.0]]], dtype=F64)
    assert_close_to(entropy_from_logits(logits), [[1.098612, 1.039721, 0.693147]])


def test_entropy_masked_vocab_no_nan_in_grad():
    # a -inf logit has p = 0: H([0, -inf, 0]) = ln 2, and the gradient stays finite
    logits = torch.tensor([[[0.0, float("-inf"), 0.0]]], dtype=F64, requires_grad=True)
    h = entropy_from_logits(logits)
    assert_close_to(h, [[LN2]])
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()


def test_entropy_matches_naive_and_keeps_dtype():
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 5, dtype=F64)
    p = torch.softmax(logits, -1)
    assert_close_to(entropy_from_logits(logits), -(p * p.log()).sum(-1), atol=1e-12)
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.bfloat16


def test_entropy_bonus_is_negative_term():
    # H = ln 3 on every token, coef 0.01 -> loss term -0.01 * ln 3 = -0.010986
    h = torch.full((2, 3), math.log(3.0))
    assert_close_to(entropy_bonus(h, torch.ones(2, 3), coef=0.01), -0.010986)


def test_topk_forward_kl_by_hand():
    # one position, vocabulary of 3: reference p = [0.5, 0.25, 0.25], policy q = [0.25, 0.25, 0.5]
    # k = 3: KL[p||q] = 0.5 ln(0.5/0.25) + 0.25 ln 1 + 0.25 ln(0.25/0.5) = 0.5 ln 2 - 0.25 ln 2 = 0.173287
    # k = 2 (the reference's two likeliest): 0.5 ln 2 + 0 = 0.346574; a masked position gives 0
    p = torch.tensor([[[0.5, 0.25, 0.25], [0.5, 0.25, 0.25]]], dtype=F64)
    q = torch.tensor([[[0.25, 0.25, 0.5], [0.25, 0.25, 0.5]]], dtype=F64)
    assert_close_to(topk_forward_kl(q.log(), p.log(), torch.tensor([[1.0, 0.0]])), [[0.173287, 0.0]])
    assert_close_to(topk_forward_kl(q[..., :2].log(), p[..., :2].log(), torch.ones(1, 2)), [[0.346574, 0.346574]])


def test_topk_forward_kl_pulls_back_a_token_the_policy_no_longer_samples():
    # reference p = [0.4, 0.4, 0.2]; the policy has nearly dropped token 2: q = [0.9, 0.099, 0.001]
    # exact KL gradient in the logits: q - p = [0.5, -0.301, -0.199] -> token 2 is pulled up by 0.199
    # k3 on the token it samples (0): (1 - p0/q0)(e_0 - q) = 0.555556 * [0.1, -0.099, -0.001]
    #   = [0.055556, -0.055, -0.000556] -> token 2 is pulled up by 0.000556, 358 times less
    p = torch.tensor([0.4, 0.4, 0.2], dtype=F64)
    z = torch.tensor([0.9, 0.099, 0.001], dtype=F64).log().requires_grad_(True)
    topk_forward_kl(torch.log_softmax(z, -1)[None, None], p.log()[None, None], torch.ones(1, 1)).sum().backward()
    assert_close_to(z.grad, [0.5, -0.301, -0.199])
    z3 = z.detach().clone().requires_grad_(True)
    kl_k3(torch.log_softmax(z3, -1)[0].reshape(1, 1), p.log()[0].reshape(1, 1)).sum().backward()
    assert_close_to(z3.grad, [0.055556, -0.055, -0.000556])
