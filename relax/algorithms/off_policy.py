"""Off-policy corrections for stale samples and trainer/engine numerical mismatch.

Two log-probs of the same sampled token meet here:

* ``target_logprobs`` (B, T): the policy the trainer's ratio is anchored at -- pi_old
  recomputed by the trainer, or AReaL's proximal policy pi_prox;
* ``behav_logprobs`` (B, T): what the policy that *sampled* the token reported -- the
  rollout engine's log-probs (possibly several versions stale, possibly from a
  different kernel/precision than the trainer).

Every correction returns a :class:`Correction` ``(weights, mask, metrics)``: ``weights``
(B, T) are detached importance weights to pass as ``is_weights`` to a loss in
:mod:`relax.algorithms.losses`, ``mask`` (B, T) the loss mask to use from then on (icepop
removes tokens from it), and detached scalar metrics. The loss itself is then computed with
``old_logprobs = target_logprobs``. Ratios are formed in log space, so a long sequence's
product of ratios cannot overflow.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from relax.algorithms.aggregation import masked_max, masked_mean, masked_sum
from relax.algorithms.losses import Metrics, ppo_loss

__all__ = [
    "OFF_POLICY",
    "Correction",
    "decoupled_ppo_loss",
    "decoupled_weights",
    "icepop",
    "no_correction",
    "off_policy_correction",
    "tis_weights",
]


class Correction(NamedTuple):
    weights: Tensor
    mask: Tensor
    metrics: Metrics


def _float(mask: Tensor, like: Tensor) -> Tensor:
    return mask.to(like.dtype)


def _log_ratio(target_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, level: str) -> Tensor:
    # Masked positions get log-ratio 0 (ratio 1) so padding cannot trip a bound or overflow.
    m = _float(mask, target_logprobs)
    diff = torch.where(m > 0, (target_logprobs - behav_logprobs).detach(), torch.zeros_like(m))
    if level == "token":
        return diff
    if level == "sequence":
        return masked_sum(diff, m, dim=-1).unsqueeze(-1).expand_as(diff)
    raise ValueError(f"unknown level {level!r}; valid: sequence, token")


def _metrics(log_ratio: Tensor, weights: Tensor, mask: Tensor) -> Metrics:
    return {
        "mismatch_kl": masked_mean(torch.expm1(log_ratio) - log_ratio, mask),
        "is_weight_mean": masked_mean(weights, mask),
        "is_weight_max": masked_max(weights, mask),
    }


def no_correction(target_logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, **_: object) -> Correction:
    """No correction: weights 1, mask unchanged; metrics still report the mismatch so a run can
    see what it is ignoring. Config ``none`` takes the ratio against the behaviour log-probs,
    ``recompute`` against the trainer's own (verl's and slime's default). Shapes: (B, T) ->
    Correction of (B, T)."""
    m = _float(mask, target_logprobs)
    log_ratio = _log_ratio(target_logprobs, behav_logprobs, m, "token")
    weights = torch.ones_like(m)
    return Correction(weights, m, _metrics(log_ratio, weights, m))


def decoupled_weights(
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    mask: Tensor,
    cap: float | None = None,
) -> Correction:
    """Decoupled PPO behaviour weight ("AReaL: A Large-Scale Asynchronous Reinforcement
    Learning System for Language Reasoning", arXiv:2505.24298; config ``decoupled``).

    Formula: w_t = sg[pi_prox(y_t) / pi_behav(y_t)]; the objective is
    w_t * min(r_t A_t, clip(r_t) A_t) with r_t = pi_theta / pi_prox, i.e. the clip is around
    the recent proximal policy and the (stale) behaviour policy only enters through w. With
    ``cap``, tokens with w_t > cap are dropped from the mask (weight 0), as AReaL's
    ``behav_imp_weight_cap``. Shapes: (B, T) -> Correction of (B, T).
    """
    m = _float(mask, prox_logprobs)
    log_ratio = _log_ratio(prox_logprobs, behav_logprobs, m, "token")
    weights = log_ratio.exp()
    if cap is not None:
        m = m * (log_ratio <= math.log(cap)).to(m.dtype)
        weights = weights * m
    metrics = _metrics(log_ratio, weights, _float(mask, m))
    metrics["kept_frac"] = masked_mean(m, _float(mask, m))
    return Correction(weights, m, metrics)


def tis_weights(
    target_logprobs: Tensor,
    behav_logprobs: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> Correction:
    """Truncated importance sampling, TIS (config ``tis``, cap ``is_cap``; Ionides,
    "Truncated Importance Sampling", 2008; applied to the trainer/engine mismatch in Yao et
    al., "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training", 2025,
    https://fengyao.notion.site/off-policy-rl).

    Formula: token level w_t = sg[min(pi_target(y_t) / pi_behav(y_t), C)]; sequence level
    w_i = sg[min(prod_t pi_target / pi_behav, C)] on every token of sequence i. Truncation
    trades a little bias for bounded variance; mask unchanged.
    Shapes: (B, T) -> Correction of (B, T) (``truncated_frac``: share of capped tokens).
    """
    if cap < 1.0:
        raise ValueError(f"is_cap must be >= 1, got {cap}")
    m = _float(mask, target_logprobs)
    log_ratio = _log_ratio(target_logprobs, behav_logprobs, m, level)
    log_cap = math.log(cap)
    weights = log_ratio.clamp(max=log_cap).exp() * m
    metrics = _metrics(log_ratio, weights, m)
    metrics["truncated_frac"] = masked_mean((log_ratio > log_cap).to(m.dtype), m)
    return Correction(weights, m, metrics)


def icepop(
    target_logprobs: Tensor,
    behav_logprobs: Tensor,
    mask: Tensor,
    cap: float = 2.0,
    level: str = "token",
) -> Correction:
    """Masked importance sampling, "IcePop" (Ling Team, "Every Step Evolves: Scaling
    Reinforcement Learning for Trillion-Scale Thinking Model", arXiv:2510.18855; config
    ``icepop``, bound ``is_cap``, i.e. [alpha, beta] = [1/C, C]).

    Formula: k = pi_target / pi_behav (token, or the product over sequence i);
    keep = 1[1/C <= k <= C]; w = sg[k] * keep; mask' = mask * keep. Tokens (sequences) whose
    engines disagree too much are dropped entirely instead of being down-weighted, since
    their gradient is mostly mismatch noise. Aggregate with ``mask'`` to renormalise over
    the kept tokens (verl style) or with the original mask to keep IcePop's normalisation.
    Shapes: (B, T) -> Correction of (B, T) (``kept_frac``: share of kept tokens).
    """
    if cap < 1.0:
        raise ValueError(f"is_cap must be >= 1, got {cap}")
    m = _float(mask, target_logprobs)
    log_ratio = _log_ratio(target_logprobs, behav_logprobs, m, level)
    log_cap = math.log(cap)
    keep = (log_ratio.abs() <= log_cap).to(m.dtype) * m
    weights = log_ratio.exp() * keep
    metrics = _metrics(log_ratio, weights, m)
    metrics["kept_frac"] = masked_mean(keep, m)
    return Correction(weights, keep, metrics)


#: Config name (``AlgorithmConfig.off_policy``) -> correction
#: f(target_logprobs, behav_logprobs, mask, ...) -> Correction.
OFF_POLICY: dict[str, Callable[..., Correction]] = {
    "none": no_correction,
    "recompute": no_correction,
    "decoupled": decoupled_weights,
    "tis": tis_weights,
    "icepop": icepop,
}


def off_policy_correction(
    name: str,
    target_logprobs: Tensor,
    behav_logprobs: Tensor,
    mask: Tensor,
    *,
    cap: float = 2.0,
    level: str = "token",
) -> Correction:
    """Any correction by config name. ``cap`` (``is_cap``) is the TIS cap, the icepop bound and
    decoupled's drop bound (AReaL's ``behav_imp_weight_cap``); ``level`` applies to TIS and icepop.
    Raises ValueError for an unknown ``name``."""
    if name not in OFF_POLICY:
        raise ValueError(f"unknown off_policy {name!r}; valid: {', '.join(sorted(OFF_POLICY))}")
    if name in ("none", "recompute"):  # they differ only in the anchor the caller takes the ratio against
        return no_correction(target_logprobs, behav_logprobs, mask)
    if name == "decoupled":
        # Uncapped, one stale token the behaviour policy found e^-12 likely and pi_prox now
        # expects carries a weight of 1e5 and is the whole (norm-clipped) step: see
        # docs/history/learning-recipe.md, "Where the gradient spikes came from".
        return decoupled_weights(target_logprobs, behav_logprobs, mask, cap=cap)
    return OFF_POLICY[name](target_logprobs, behav_logprobs, mask, cap=cap, level=level)


def decoupled_ppo_loss(
    logprobs: Tensor,
    prox_logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    cap: float | None = None,
) -> tuple[Tensor, Metrics]:
    """Decoupled PPO loss (AReaL, arXiv:2505.24298), :func:`decoupled_weights` + PPO-clip.

    Formula: l_t = -sg[pi_prox/pi_behav] * min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high)
    A_t), r_t = pi_theta / pi_prox. Shapes: all (B, T) -> loss (B, T) (0 on tokens dropped
    by ``cap``), metrics of both parts (correction metrics prefixed ``behav_``).
    """
    corr = decoupled_weights(prox_logprobs, behav_logprobs, mask, cap=cap)
    loss, metrics = ppo_loss(
        logprobs, prox_logprobs, advantages, corr.mask,
        clip_low=clip_low, clip_high=clip_high, is_weights=corr.weights,
    )
    metrics.update({f"behav_{k}": v for k, v in corr.metrics.items()})
    return loss, metrics
