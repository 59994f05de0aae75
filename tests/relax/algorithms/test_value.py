"""The critic's clipped value loss, with expected values derived by hand on three tokens."""

from __future__ import annotations

import math

import torch
from hand_values import assert_close_to

from relax.algorithms import clipped_value_loss, value_loss


def test_clipped_value_loss_by_hand():
    # clip eps = 0.5, mask (1, 1, 0):
    # token 0: V=1, V_old=0, R=2. (V-R)^2 = 1. V - V_old = 1 clips to 0.5: V_clip = 0.5,
    #          (V_clip-R)^2 = 2.25. L = 0.5 * max(1, 2.25) = 1.125; the clipped branch wins and
    #          does not depend on V, so dL/dV = 0 (V already moved eps towards R).
    # token 1: V=3, V_old=2, R=2. (V-R)^2 = 1; V_clip = 2.5, (V_clip-R)^2 = 0.25.
    #          L = 0.5 * max(1, 0.25) = 0.5; the unclipped branch wins: dL/dV = V - R = 1
    #          (moving away from R is never clipped).
    # token 2: masked: L = 0, dL/dV = 0.
    values = torch.tensor([[1.0, 3.0, 0.5]], requires_grad=True)
    old = torch.tensor([[0.0, 2.0, 0.0]])
    returns = torch.tensor([[2.0, 2.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss, metrics = value_loss(values, old, returns, mask, clip=0.5)
    assert_close_to(loss, [[1.125, 0.5, 0.0]])
    loss.sum().backward()
    assert_close_to(values.grad, [[0.0, 1.0, 0.0]])
    # clip frac: token 0 of the 2 masked ones = 0.5; mse (1 + 1) / 2 = 1;
    # value mean (1 + 3) / 2 = 2; return mean (2 + 2) / 2 = 2
    assert_close_to(metrics["value_clip_frac"], 0.5)
    assert_close_to(metrics["value_mse"], 1.0)
    assert_close_to(metrics["value_mean"], 2.0)
    assert_close_to(metrics["return_mean"], 2.0)


def test_clip_zero_is_half_squared_error():
    # clip 0 (or None) disables the clip: L = 0.5 (V - R)^2 = 0.5 * (1, 1, 0.25) on (1-2, 3-2, 0.5-1)
    values = torch.tensor([1.0, 3.0, 0.5])
    old = torch.tensor([0.0, 2.0, 0.0])
    returns = torch.tensor([2.0, 2.0, 1.0])
    for clip in (0.0, None):
        assert_close_to(clipped_value_loss(values, old, returns, clip), [0.5, 0.5, 0.125])


def test_nan_off_the_mask_stays_out_of_value_and_gradient():
    values = torch.tensor([[1.0, math.nan, 2.0]], requires_grad=True)
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    # tokens 0 and 2 unclipped (V = V_old): 0.5 * (1-0)^2 = 0.5 and 0.5 * (2-1)^2 = 0.5
    loss, _ = value_loss(values, torch.tensor([[1.0, 0.0, 2.0]]), torch.tensor([[0.0, 5.0, 1.0]]), mask, clip=0.2)
    assert_close_to(loss, [[0.5, 0.0, 0.5]])
    loss.sum().backward()
    assert_close_to(values.grad, [[1.0, 0.0, 1.0]])
