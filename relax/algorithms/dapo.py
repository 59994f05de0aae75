"""DAPO's sample-level techniques ("DAPO: An Open-Source LLM Reinforcement Learning System
at Scale", arXiv:2503.14476). Clip-higher lives in :func:`relax.algorithms.losses.ppo_loss`
(``clip_high``) and token-level aggregation in :mod:`relax.algorithms.aggregation`; here:

* dynamic sampling (``RolloutConfig.dynamic_sampling``): a prompt group whose rewards are
  all equal has zero group-relative advantage, so it only dilutes the batch; drop it and
  let rollout over-sample to refill;
* overlong reward shaping: a soft length penalty in the last ``buffer`` tokens before the
  length limit, so truncation is not punished as harshly (and as noisily) as a wrong
  answer, and the policy learns to finish in time;
* overlong filtering: take truncated responses out of the loss entirely.

Group convention as in :mod:`relax.algorithms.advantages`: rewards (B,), contiguous groups
of ``group_size``.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "dynamic_sampling_filter",
    "dynamic_sampling_stats",
    "overlong_filter",
    "overlong_penalty",
]


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a multiple of group_size={group_size}")
    return rewards.view(-1, group_size)


def dynamic_sampling_filter(rewards: Tensor, group_size: int, atol: float = 0.0) -> tuple[Tensor, Tensor]:
    """DAPO dynamic sampling: keep prompt groups whose rewards are not all equal.

    Formula: keep_g = (max_{i in g} r_i - min_{i in g} r_i) > atol. ``atol = 0`` is DAPO's
    "std > 0" test without the float noise of computing a std; raise it for continuous
    rewards where near-ties carry no signal. A group of one sample is never kept (its
    group-relative advantage is always 0).
    Shapes: rewards (B,) -> (keep per group (B/G,) bool, keep per sample (B,) bool).
    """
    groups = _groups(rewards, group_size)
    keep_group = (groups.amax(dim=-1) - groups.amin(dim=-1)) > atol
    return keep_group, keep_group.repeat_interleave(group_size)


def dynamic_sampling_stats(rewards: Tensor, group_size: int, atol: float = 0.0) -> dict[str, Tensor]:
    """What the filter would do to this batch, for logging: ``kept_frac`` (share of groups
    kept), ``all_max_frac`` / ``all_min_frac`` (share of groups that are constant at the
    batch's best / worst reward: "too easy" / "too hard" prompts).
    Shapes: rewards (B,) -> dict of 0-d float tensors.
    """
    groups = _groups(rewards, group_size).detach()
    keep, _ = dynamic_sampling_filter(rewards, group_size, atol)
    constant = ~keep
    lo, hi = groups.amin(dim=-1), groups.amax(dim=-1)
    best, worst = rewards.max(), rewards.min()
    as_float = {"dtype": rewards.dtype if rewards.is_floating_point() else torch.float32}
    return {
        "kept_frac": keep.to(**as_float).mean(),
        "all_max_frac": (constant & (lo == best)).to(**as_float).mean(),
        "all_min_frac": (constant & (hi == worst)).to(**as_float).mean(),
    }


def overlong_penalty(
    lengths: Tensor,
    max_length: int,
    buffer: int,
    penalty_factor: float = 1.0,
) -> Tensor:
    """DAPO soft overlong punishment (eq. 13 of arXiv:2503.14476), to ADD to the reward.

    Formula, L = |y|, L_max = ``max_length``, L_cache = ``buffer``:
        R_len = 0                                    if L <= L_max - L_cache
              = ((L_max - L_cache) - L) / L_cache    if L_max - L_cache < L <= L_max
              = -1                                   if L > L_max
    times ``penalty_factor``. The penalty grows linearly from 0 to -1 across the buffer.
    Shapes: lengths (B,) (e.g. ``mask.sum(-1)``) -> (B,) float.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"need 0 < buffer <= max_length, got buffer={buffer}, max_length={max_length}")
    length = lengths.to(torch.float64 if lengths.dtype == torch.float64 else torch.float32)
    soft_start = max_length - buffer
    ramp = (soft_start - length) / buffer
    penalty = torch.where(length <= soft_start, torch.zeros_like(length), ramp)
    penalty = torch.where(length > max_length, torch.full_like(length, -1.0), penalty)
    return penalty * penalty_factor


def overlong_filter(mask: Tensor, truncated: Tensor) -> Tensor:
    """DAPO overlong filtering: drop truncated responses from the loss.

    Formula: m'_it = m_it * (1 - truncated_i). A truncated answer is not wrong, only
    unfinished; its (usually zero) reward would teach the wrong lesson. The row becomes all
    zero, which every aggregation in :mod:`relax.algorithms.aggregation` handles.
    Shapes: mask (B, T), truncated (B,) bool -> (B, T), mask's dtype.
    """
    keep = (~truncated.bool()).unsqueeze(-1)
    return mask * keep if mask.dtype == torch.bool else mask * keep.to(mask.dtype)
