"""Policy-gradient losses: per-token loss (B, T) to be MINIMISED, plus metrics.

Common signature: ``loss_fn(logprobs, old_logprobs, advantages, mask, *, clip_low,
clip_high, is_weights=None) -> (loss (B, T), metrics)``.

* ``logprobs`` (B, T): log pi_theta(y_t | y_<t) of the sampled tokens; carries the graph.
* ``old_logprobs`` (B, T): the policy the ratio is taken against (pi_old; with decoupled
  PPO the proximal policy pi_prox). Never differentiated.
* ``advantages`` (B, T): per-token advantages (sequence advantages broadcast with
  :func:`relax.algorithms.advantages.broadcast_to_tokens`).
* ``mask`` (B, T) float/bool, 1 on response tokens. The returned loss is exactly 0 off the
  mask (a NaN in a padded log-prob cannot leak through).
* ``is_weights`` (B, T): optional off-policy weight per token (decoupled PPO, TIS, icepop;
  see :mod:`relax.algorithms.off_policy`), multiplied in with stop-gradient.

Ratios are computed as exp(clamp(logp - logp_old, -20, 20)): the clamp only bites for
samples the clip would ignore anyway, and keeps exp() from overflowing to inf * 0 = NaN.
Metrics are detached 0-d tensors averaged over response tokens (no host sync here):
``clip_frac`` (share of tokens whose gradient the clip removed), ``clip_frac_low`` /
``clip_frac_high``, ``approx_kl`` (k3 estimate of KL[pi_old || pi_theta]) and
``ratio_mean``. Reduce the loss with :mod:`relax.algorithms.aggregation`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relax.algorithms.aggregation import masked_mean

__all__ = [
    "POLICY_LOSSES",
    "cispo_loss",
    "compute_policy_loss",
    "dual_clip_loss",
    "gspo_loss",
    "gspo_token_loss",
    "ppo_loss",
]

Metrics = dict[str, Tensor]
_MAX_LOG_RATIO = 20.0


def _off_mask_zero(x: Tensor, mask: Tensor) -> Tensor:
    # where() before any exp/log: a NaN log-prob on padding then gets a 0 gradient instead of
    # 0 * NaN = NaN in the backward pass.
    return torch.where(mask.to(x.dtype) > 0, x, torch.zeros_like(x))


def _inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(clamped log-ratio, advantages), both 0 off the mask."""
    diff = _off_mask_zero(logprobs - old_logprobs.detach(), mask)
    return diff.clamp(-_MAX_LOG_RATIO, _MAX_LOG_RATIO), _off_mask_zero(advantages.detach(), mask)


def _finish(per_token: Tensor, mask: Tensor, is_weights: Tensor | None) -> Tensor:
    if is_weights is not None:
        per_token = per_token * _off_mask_zero(is_weights.detach(), mask)
    m = mask.to(per_token.dtype)
    return torch.where(m > 0, per_token * m, torch.zeros_like(per_token))


def _base_metrics(log_ratio: Tensor, mask: Tensor) -> Metrics:
    lr = log_ratio.detach()
    return {
        "approx_kl": masked_mean(torch.expm1(lr) - lr, mask),
        "ratio_mean": masked_mean(lr.exp(), mask),
    }


def _clip_metrics(clipped: Tensor, ratio: Tensor, mask: Tensor) -> Metrics:
    """Share of tokens whose gradient the clip removed, in all and per side."""
    return {"clip_frac": _frac(clipped, mask), "clip_frac_low": _frac(clipped & (ratio < 1.0), mask),
            "clip_frac_high": _frac(clipped & (ratio > 1.0), mask)}


def _frac(flag: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(flag.detach().to(mask.dtype if mask.is_floating_point() else torch.float32), mask)


def _clipped_surrogate(
    ratio: Tensor, advantages: Tensor, clip_low: float, clip_high: float
) -> tuple[Tensor, Tensor, Tensor]:
    # max of the two negated surrogates == -min(r A, clip(r) A); returns the loss and where
    # the clipped branch won (its gradient w.r.t. the ratio is then 0).
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped, ratio


def _check_clip(clip_low: float, clip_high: float) -> None:
    # clip_low = 1 (lower bound 0) is legal: CISPO runs without a lower bound.
    if not 0.0 <= clip_low <= 1.0 or clip_high < 0.0:
        raise ValueError(f"need 0 <= clip_low <= 1 and clip_high >= 0, got {clip_low}, {clip_high}")


def ppo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """PPO-clip with asymmetric clip range ("Proximal Policy Optimization Algorithms",
    arXiv:1707.06347; clip-higher from DAPO, arXiv:2503.14476; config ``ppo``).

    Formula: r_t = exp(logp_t - logp_old_t);
    l_t = -min(r_t A_t, clip(r_t, 1 - eps_low, 1 + eps_high) A_t) * w_t, w = is_weights.
    eps_high > eps_low (DAPO: 0.2 / 0.28) lets low-probability tokens grow, fighting
    entropy collapse. Shapes: all (B, T) -> loss (B, T), metrics.
    """
    _check_clip(clip_low, clip_high)
    log_ratio, advantages = _inputs(logprobs, old_logprobs, advantages, mask)
    loss, clipped, ratio = _clipped_surrogate(log_ratio.exp(), advantages, clip_low, clip_high)
    metrics = {**_base_metrics(log_ratio, mask), **_clip_metrics(clipped, ratio, mask)}
    return _finish(loss, mask, is_weights), metrics


def dual_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float = 3.0,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Dual-clip PPO ("Mastering Complex Control in MOBA Games with Deep Reinforcement
    Learning", Ye et al., arXiv:1912.09729; config ``dual_clip``, constant ``dual_clip_c``).

    Formula: l_t = PPO-clip l_t (see :func:`ppo_loss`) when A_t >= 0; when A_t < 0,
    l_t = min(PPO-clip l_t, -c A_t), c > 1. A very off-policy token (r >> 1) with a negative
    advantage would otherwise get an unbounded loss -r A; the second clip bounds it at c|A|.
    Shapes: all (B, T) -> loss (B, T), metrics (adds ``dual_clip_frac``).
    """
    if dual_clip_c <= 1.0:
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    _check_clip(clip_low, clip_high)
    log_ratio, advantages = _inputs(logprobs, old_logprobs, advantages, mask)
    ppo, clipped, ratio = _clipped_surrogate(log_ratio.exp(), advantages, clip_low, clip_high)
    bound = -dual_clip_c * advantages
    dual = (advantages < 0) & (bound < ppo)
    loss = torch.where(dual, bound, ppo)
    metrics = _base_metrics(log_ratio, mask)
    metrics["clip_frac"] = _frac(clipped | dual, mask)
    metrics["clip_frac_low"] = _frac(clipped & (ratio < 1.0), mask)
    metrics["clip_frac_high"] = _frac(clipped & (ratio > 1.0), mask)
    metrics["dual_clip_frac"] = _frac(dual, mask)
    return _finish(loss, mask, is_weights), metrics


def _seq_log_ratio(log_ratio: Tensor, mask: Tensor) -> Tensor:
    return masked_mean(log_ratio, mask, dim=-1).unsqueeze(-1)


def _upper(log_ratio: Tensor, seq_clamp: float) -> Tensor:
    # verl bounds GSPO's log-ratio above at 10 (e^10 = 2.2e4); beyond it the token has no gradient
    if seq_clamp < 0:
        raise ValueError(f"seq_clamp must be >= 0 (0 = no bound), got {seq_clamp}")
    return log_ratio.clamp(max=seq_clamp) if seq_clamp > 0 else log_ratio


def gspo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
    seq_clamp: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """Group Sequence Policy Optimization, sequence ratio ("Group Sequence Policy
    Optimization", arXiv:2507.18071, eq. 5-7; config ``gspo``).

    Formula: s_i = exp( (1/|y_i|) sum_t m_it (logp_it - logp_old_it) ) (length-normalised
    sequence ratio), A_i = masked mean of A_it over the sequence,
    L_i = -min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i); every response token of
    sequence i carries L_i (times its is_weight), so ``seq-mean-token-mean`` aggregation
    reproduces the paper's (1/G) sum_i L_i. The paper's clip range is ~1e-3, not PPO's 0.2.
    This is the sequence form: with per-token advantages it averages them first, so it
    differs from verl's ``gspo`` (the GSPO-token form, :func:`gspo_token_loss`) unless A is
    constant over each sequence. ``seq_clamp`` > 0 bounds log s_i above (verl: 10).
    Shapes: all (B, T) -> loss (B, T), metrics (clip fractions count sequences' tokens).
    """
    _check_clip(clip_low, clip_high)
    log_ratio, advantages = _inputs(logprobs, old_logprobs, advantages, mask)
    seq_adv = masked_mean(advantages, mask, dim=-1).unsqueeze(-1)
    seq_loss, clipped, ratio = _clipped_surrogate(
        _upper(_seq_log_ratio(log_ratio, mask), seq_clamp).exp(), seq_adv, clip_low, clip_high
    )
    loss = seq_loss.expand_as(log_ratio)
    metrics = _base_metrics(log_ratio, mask)
    metrics["clip_frac"] = _frac(clipped.expand_as(log_ratio), mask)
    metrics["clip_frac_low"] = _frac((clipped & (ratio < 1.0)).expand_as(log_ratio), mask)
    metrics["clip_frac_high"] = _frac((clipped & (ratio > 1.0)).expand_as(log_ratio), mask)
    return _finish(loss, mask, is_weights), metrics


def gspo_token_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
    seq_clamp: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """GSPO-token: sequence ratio value, per-token gradient (arXiv:2507.18071, sec. 4.3, eq. 13;
    config ``gspo_token``; what verl calls ``gspo``).

    Formula: s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)] (numerically = s_i),
    l_t = -min(s_it A_it, clip(s_it, 1 - eps_low, 1 + eps_high) A_it). With A constant over
    a sequence and ``seq-mean-token-mean`` aggregation its gradient equals GSPO's; it also
    admits per-token advantages (e.g. multi-turn credit assignment). ``seq_clamp`` > 0 bounds
    log s_it above (verl: 10). Shapes: all (B, T) -> loss (B, T), metrics.
    """
    _check_clip(clip_low, clip_high)
    log_ratio, advantages = _inputs(logprobs, old_logprobs, advantages, mask)
    seq = _seq_log_ratio(log_ratio, mask).detach()
    token_log_ratio = _upper(seq + _off_mask_zero(logprobs - logprobs.detach(), mask), seq_clamp)
    loss, clipped, ratio = _clipped_surrogate(token_log_ratio.exp(), advantages, clip_low, clip_high)
    metrics = {**_base_metrics(log_ratio, mask), **_clip_metrics(clipped, ratio, mask)}
    return _finish(loss, mask, is_weights), metrics


def cispo_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    is_weights: Tensor | None = None,
) -> tuple[Tensor, Metrics]:
    """Clipped IS-weight Policy Optimization ("MiniMax-M1: Scaling Test-Time Compute
    Efficiently with Lightning Attention", arXiv:2506.13585; config ``cispo``).

    Formula: l_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] * A_t * logp_t. The IS weight
    is clipped but, unlike PPO, no token's gradient is dropped: clipped tokens still push
    with a bounded weight. The loss *value* includes logp_t, so it is not comparable with
    PPO's; only its gradient is meaningful. MiniMax effectively leaves the lower bound off
    (a large eps_low) and tunes eps_high.
    Shapes: all (B, T) -> loss (B, T), metrics.
    """
    _check_clip(clip_low, clip_high)
    log_ratio, advantages = _inputs(logprobs, old_logprobs, advantages, mask)
    ratio = log_ratio.detach().exp()
    weight = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = -weight * advantages * _off_mask_zero(logprobs, mask)
    metrics = _base_metrics(log_ratio, mask)
    metrics["clip_frac_low"] = _frac(ratio < 1.0 - clip_low, mask)
    metrics["clip_frac_high"] = _frac(ratio > 1.0 + clip_high, mask)
    metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    return _finish(loss, mask, is_weights), metrics


#: Config name (``AlgorithmConfig.policy_loss``) -> loss. All share the common signature;
#: ``dual_clip`` also takes ``dual_clip_c``.
POLICY_LOSSES: dict[str, Callable[..., tuple[Tensor, Metrics]]] = {
    "ppo": ppo_loss,
    "dual_clip": dual_clip_loss,
    "gspo": gspo_loss,
    "gspo_token": gspo_token_loss,
    "cispo": cispo_loss,
}


def compute_policy_loss(
    name: str,
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_low: float = 0.2,
    clip_high: float = 0.28,
    dual_clip_c: float = 3.0,
    is_weights: Tensor | None = None,
    seq_clamp: float = 0.0,
) -> tuple[Tensor, Metrics]:
    """Any policy loss by config name with every config knob; knobs a loss does not use are
    ignored (``seq_clamp``: the GSPO losses' log-ratio bound). Returns (loss (B, T), metrics).
    Raises ValueError for an unknown ``name``."""
    if name not in POLICY_LOSSES:
        raise ValueError(f"unknown policy_loss {name!r}; valid: {', '.join(sorted(POLICY_LOSSES))}")
    kw: dict = {"clip_low": clip_low, "clip_high": clip_high, "is_weights": is_weights}
    if name == "dual_clip":
        kw["dual_clip_c"] = dual_clip_c
    if name in ("gspo", "gspo_token"):
        kw["seq_clamp"] = seq_clamp
    return POLICY_LOSSES[name](logprobs, old_logprobs, advantages, mask, **kw)
