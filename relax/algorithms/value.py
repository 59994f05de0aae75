"""The critic's loss: PPO's clipped value loss, per token, to be MINIMISED.

PPO ("Proximal Policy Optimization Algorithms", Schulman et al., arXiv:1707.06347, eq. 9
with the value clipping of OpenAI baselines' ``ppo2``; OpenRLHF's ``ValueLoss``):

    V_clip = V_old + clip(V - V_old, -eps, eps)
    L_t    = 0.5 * max((V_t - R_t)^2, (V_clip_t - R_t)^2)

``V`` (B, T) are the critic's current values (they carry the graph), ``V_old`` (B, T) the
values the same critic gave when the rollout's advantages were computed (the ones GAE
used), ``R`` (B, T) the GAE returns ``A + V_old`` (the regression target). Taking the
larger of the two squared errors is pessimistic, like the policy clip: a step that moves
V more than ``eps`` from V_old towards R gets no further gradient, one that moves it away
still does. ``eps = 0`` (or None) is the plain 0.5 * (V - R)^2.

Reduce the per-token loss with :mod:`relax.algorithms.aggregation`, like policy losses.
"""

from __future__ import annotations

import torch
from torch import Tensor

from relax.algorithms.aggregation import masked_mean

__all__ = ["clipped_value_loss", "value_loss"]


def clipped_value_loss(values: Tensor, old_values: Tensor, returns: Tensor, clip: float | None) -> Tensor:
    """Elementwise 0.5 * max((V - R)^2, (V_old + clip(V - V_old, -c, c) - R)^2); any shape, no mask.

    ``clip`` None or 0 gives the unclipped 0.5 * (V - R)^2.
    """
    old_values, returns = old_values.detach(), returns.detach()
    plain = (values - returns) ** 2
    if not clip:
        return 0.5 * plain
    clipped = old_values + (values - old_values).clamp(-clip, clip)
    return 0.5 * torch.maximum(plain, (clipped - returns) ** 2)


def value_loss(values: Tensor, old_values: Tensor, returns: Tensor, mask: Tensor, *,
               clip: float | None = 0.2) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: values, old_values, returns, mask (B, T) -> (loss (B, T), metrics).

    The loss is exactly 0 off the mask (padding and prompt tokens have no return). Metrics
    are detached 0-d tensors over the mask: ``value_clip_frac`` (share of tokens where the
    clipped branch is the larger, so the clip removed the gradient), ``value_mse`` (mean
    (V - R)^2) and ``value_mean`` / ``return_mean``.
    """
    m = mask.to(values.dtype)
    keep = m > 0
    # where() before squaring: a NaN value on padding must not turn into 0 * NaN in backward
    v = torch.where(keep, values, torch.zeros_like(values))
    old = torch.where(keep, old_values.detach().to(values.dtype), torch.zeros_like(values))
    ret = torch.where(keep, returns.detach().to(values.dtype), torch.zeros_like(values))
    loss = clipped_value_loss(v, old, ret, clip) * m
    with torch.no_grad():
        plain = (v - ret) ** 2
        clipped_frac = ((2 * loss > plain + 1e-12) & keep).to(values.dtype)
        metrics = {"value_clip_frac": masked_mean(clipped_frac, m), "value_mse": masked_mean(plain, m),
                   "value_mean": masked_mean(v, m), "return_mean": masked_mean(ret, m)}
    return loss, metrics
