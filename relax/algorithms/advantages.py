"""Advantage estimators: from rewards (and values) to the A that weights each token's gradient.

Group convention (every group-based estimator): ``rewards`` is ``(B,)`` with
``B = num_groups * group_size``; the ``group_size`` (G) responses to one prompt are
*contiguous* (rows ``g*G .. g*G+G-1``), which is the order rollout emits them in.

Sequence-level estimators (GRPO, Dr.GRPO, RLOO) return ``(B,)``;
:func:`broadcast_to_tokens` turns that into ``(B, T)``. Token-level estimators
(REINFORCE++, REINFORCE++-baseline, GAE) return ``(B, T)`` directly, zero off the mask.
:func:`compute_advantages` is the one entry point the advantage service needs: it takes a
config name and always returns ``(advantages (B, T), returns (B, T) | None)``.

Std flavour: *population* std (divide by G) by default. It is defined for G = 1, gives
exactly +-1 for a two-sample group with different rewards, and matches the whitening of
REINFORCE++; ``unbiased=True`` (config ``algorithm.std_estimator=unbiased``) gives the sample
std of TRL/verl in GRPO and verl's unbiased batch whitening in REINFORCE++.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relax.algorithms.aggregation import masked_whiten

__all__ = [
    "ADVANTAGES",
    "broadcast_to_tokens",
    "compute_advantages",
    "drgrpo_advantages",
    "gae_advantages",
    "grpo_advantages",
    "outcome_to_token_rewards",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "stuck_group_push",
    "stuck_groups",
]


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (B,), got shape {tuple(rewards.shape)}")
    if group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"batch of {rewards.numel()} rewards is not a multiple of group_size={group_size}")
    return _as_float(rewards).view(-1, group_size)


def _as_float(rewards: Tensor) -> Tensor:
    # 0/1 verifier rewards often arrive as ints or bools; means and stds need floats.
    return rewards if rewards.is_floating_point() else rewards.to(torch.get_default_dtype())


def _all_equal(groups: Tensor) -> Tensor:
    return groups.amax(dim=-1, keepdim=True) == groups.amin(dim=-1, keepdim=True)


def _centred(groups: Tensor) -> Tensor:
    # A group whose rewards are all equal carries no signal; mean() of equal floats can be
    # off by one ulp, and that ulp divided by eps would become a spurious advantage.
    centred = groups - groups.mean(dim=-1, keepdim=True)
    return torch.where(_all_equal(groups), torch.zeros_like(centred), centred)


def grpo_advantages(rewards: Tensor, group_size: int, eps: float = 1e-6, unbiased: bool = False) -> Tensor:
    """GRPO group-normalised advantage ("DeepSeekMath", arXiv:2402.03300; config ``grpo``).

    Formula: A_i = (r_i - mean_g(r)) / (std_g(r) + eps), std over the G samples of i's
    group; population std unless ``unbiased``. A group with all-equal rewards gives A = 0.
    Shapes: rewards (B,) with contiguous groups of ``group_size`` -> (B,).
    """
    groups = _groups(rewards, group_size)
    std = groups.std(dim=-1, keepdim=True, unbiased=unbiased) if group_size > 1 else torch.zeros_like(groups)
    # Select after dividing, so even eps = 0 gives 0 (not 0/0) for a constant group.
    adv = _centred(groups) / (std + eps)
    return torch.where(_all_equal(groups), torch.zeros_like(adv), adv).reshape(-1)


def drgrpo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """Dr.GRPO advantage, GRPO without the std division ("Understanding R1-Zero-Like
    Training", arXiv:2503.20783; config ``drgrpo``).

    Formula: A_i = r_i - mean_g(r). Dividing by the std up-weights groups that are almost
    all right or all wrong (question-difficulty bias); Dr.GRPO drops it.
    Shapes: rewards (B,) -> (B,).
    """
    return _centred(_groups(rewards, group_size)).reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """REINFORCE Leave-One-Out ("Back to Basics: Revisiting REINFORCE Style Optimization for
    Learning from Human Feedback in LLMs", arXiv:2402.14740; config ``rloo``).

    Formula: A_i = r_i - (1/(G-1)) sum_{j != i} r_j  ( = G/(G-1) * (r_i - mean_g(r)) ).
    The baseline excludes the sample itself, so it is independent of it: unbiased.
    Shapes: rewards (B,) -> (B,); needs G >= 2.
    """
    if group_size < 2:
        raise ValueError(f"rloo needs group_size >= 2, got {group_size}")
    groups = _groups(rewards, group_size)
    others = (groups.sum(dim=-1, keepdim=True) - groups) / (group_size - 1)
    return (groups - others).reshape(-1)


def stuck_group_push(rewards: Tensor, group_size: int, beta: float, full: float = 1.0) -> Tensor:
    """Negative reinforcement for prompt groups that all missed (config ``stuck_group_push``).

    Formula: A_i = -beta * (full - r_i) when every reward of i's group is equal and below
    ``full``, else 0; added to a group estimator's advantage, which is 0 for such a group.
    A group whose G samples all give the same wrong answer carries no GRPO gradient, so an
    answer the policy stopped sampling for that prompt never comes back; pushing the shared
    wrong answer down hands its probability to the others in proportion to theirs, so the
    right one is sampled again (negative-sample reinforcement, "The Surprising Effectiveness
    of Negative Reinforcement in LLM Reasoning", Zhu et al., arXiv:2506.01347, with the
    positive side left to GRPO). All-right groups (r = full) get 0.
    Shapes: rewards (B,) with contiguous groups of ``group_size`` -> (B,).
    """
    groups = _groups(rewards, group_size)
    stuck = stuck_groups(rewards, group_size, full).unsqueeze(-1)
    return torch.where(stuck, -beta * (full - groups), torch.zeros_like(groups)).reshape(-1)


def stuck_groups(rewards: Tensor, group_size: int, full: float = 1.0) -> Tensor:
    """Which prompt groups all missed: every reward equal and below ``full``.
    Shapes: rewards (B,) with contiguous groups of ``group_size`` -> (B // group_size,) bool."""
    groups = _groups(rewards, group_size)
    return (_all_equal(groups) & (groups[:, :1] < full)).squeeze(-1)


def broadcast_to_tokens(advantages: Tensor, mask: Tensor) -> Tensor:
    """Give every response token its sequence's advantage.

    Formula: A_it = A_i * m_it. Shapes: advantages (B,), mask (B, T) -> (B, T).
    """
    return advantages.unsqueeze(-1) * mask.to(advantages.dtype)


def outcome_to_token_rewards(rewards: Tensor, mask: Tensor) -> Tensor:
    """Place each sequence's scalar reward on its last response token (outcome reward).

    Formula: R_it = r_i if t = max{t : m_it = 1} else 0; rows with no response token get 0.
    Shapes: rewards (B,), mask (B, T) -> (B, T).
    """
    rewards = _as_float(rewards)
    m = mask.to(rewards.dtype)
    positions = torch.arange(1, m.shape[-1] + 1, device=m.device, dtype=m.dtype)
    last = (m * positions).argmax(dim=-1)
    out = torch.zeros_like(m)
    has_tokens = (m.sum(dim=-1) > 0).to(rewards.dtype)
    return out.scatter(-1, last.unsqueeze(-1), (rewards * has_tokens).unsqueeze(-1))


def _discounted_returns(token_rewards: Tensor, mask: Tensor, gamma: float) -> Tensor:
    # Backwards scan; masked tokens (padding, tool observations in a multi-turn response)
    # are skipped so the discount only counts the policy's own tokens.
    m = mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    out = torch.zeros_like(token_rewards)
    for t in range(token_rewards.shape[-1] - 1, -1, -1):
        step = token_rewards[:, t] + gamma * running
        running = m[:, t] * step + (1 - m[:, t]) * running
        out[:, t] = m[:, t] * running
    return out


def reinforce_pp_advantages(
    rewards: Tensor,
    mask: Tensor,
    *,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
    unbiased: bool = False,
) -> Tensor:
    """REINFORCE++ ("REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
    Models", arXiv:2501.03262; config ``reinforce_pp``).

    Formula: token reward R_t = r * 1[t = last] - beta * KL_t; return
    G_t = sum_{s >= t} gamma^(s-t) R_s over response tokens; A = (G - mu) / sqrt(max(var,
    eps)) with mu, var the masked population mean/variance over *all tokens of the batch*
    (``unbiased``: verl's (G - mu) / sqrt(var * N/(N-1) + eps), see
    :func:`relax.algorithms.aggregation.masked_whiten`). No critic and no group: the batch
    statistics are the baseline, so call it on the whole batch, never per prompt group.
    Shapes: rewards (B,), mask (B, T), token_kl (B, T) per-token KL estimate (e.g.
    :func:`relax.algorithms.kl.kl_estimate` of old vs reference log-probs), beta =
    ``kl_coef`` -> (B, T), 0 off the mask. Gradients never flow through ``token_kl``.
    """
    token_rewards = outcome_to_token_rewards(rewards, mask)
    if token_kl is not None and kl_coef:
        token_rewards = token_rewards - kl_coef * token_kl.detach() * mask.to(token_rewards.dtype)
    return masked_whiten(_discounted_returns(token_rewards, mask, gamma), mask, eps=eps, unbiased=unbiased)


def reinforce_pp_baseline_advantages(
    rewards: Tensor,
    mask: Tensor,
    group_size: int,
    *,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    eps: float = 1e-8,
    unbiased: bool = False,
) -> Tensor:
    """REINFORCE++-baseline (arXiv:2501.03262, v2+; config ``reinforce_pp_baseline``).

    Formula: r'_i = r_i - mean_g(r) (group-mean baseline, no std), then exactly
    :func:`reinforce_pp_advantages` on r': KL folded into token rewards, discounted
    returns, batch whitening over all tokens. The group baseline removes prompt difficulty;
    the batch std (not the group std) keeps the scale stable without GRPO's bias.
    Shapes: rewards (B,) contiguous groups, mask (B, T), token_kl (B, T) -> (B, T).
    """
    centred = drgrpo_advantages(rewards, group_size)
    return reinforce_pp_advantages(centred, mask, token_kl=token_kl, kl_coef=kl_coef, gamma=gamma, eps=eps,
                                   unbiased=unbiased)


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[Tensor, Tensor]:
    """Generalised Advantage Estimation ("High-Dimensional Continuous Control Using
    Generalized Advantage Estimation", Schulman et al., arXiv:1506.02438; config ``gae``).

    Formula: delta_t = R_t + gamma * V_{t+1} - V_t, A_t = delta_t + gamma * lam * A_{t+1},
    returns_t = A_t + V_t (the critic's target). "t+1" is the next *response* token: masked
    positions (padding, tool outputs inside a multi-turn response) are skipped and carry
    V and A through; after the last response token V = 0 (the episode ended).
    Not whitened here; PPO usually whitens with :func:`relax.algorithms.aggregation.masked_whiten`.
    Shapes: token_rewards, values, mask (B, T) -> (advantages (B, T), returns (B, T)),
    both 0 off the mask. ``values`` is detached: advantages are targets, not graph nodes.
    """
    m = mask.to(token_rewards.dtype)
    v = values.detach().to(token_rewards.dtype)
    next_value = torch.zeros_like(v[:, 0])
    next_adv = torch.zeros_like(v[:, 0])
    adv = torch.zeros_like(v)
    for t in range(v.shape[-1] - 1, -1, -1):
        delta = token_rewards[:, t] + gamma * next_value - v[:, t]
        here = delta + gamma * lam * next_adv
        next_adv = m[:, t] * here + (1 - m[:, t]) * next_adv
        next_value = m[:, t] * v[:, t] + (1 - m[:, t]) * next_value
        adv[:, t] = m[:, t] * here
    return adv, (adv + v) * m


#: Config name (``AlgorithmConfig.advantage``) -> estimator. Signatures differ (group-based,
#: token-level, critic-based); :func:`compute_advantages` gives them one calling convention.
ADVANTAGES: dict[str, Callable[..., Tensor | tuple[Tensor, Tensor]]] = {
    "grpo": grpo_advantages,
    "drgrpo": drgrpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
    "gae": gae_advantages,
}


def compute_advantages(
    name: str,
    rewards: Tensor,
    mask: Tensor,
    *,
    group_size: int = 1,
    values: Tensor | None = None,
    token_kl: Tensor | None = None,
    kl_coef: float = 0.0,
    gamma: float = 1.0,
    lam: float = 0.95,
    eps: float = 1e-6,
    stuck_push: float = 0.0,
    unbiased: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Any estimator by config name, one signature: -> (advantages (B, T), returns or None).

    rewards (B,) outcome rewards; mask (B, T); values (B, T) only for ``gae``; token_kl
    (B, T) with ``kl_coef`` = beta folds a KL penalty into the reward (``kl_in_reward``):
    token-level estimators receive -beta * KL_t per token, sequence-level ones the
    sequence total r_i - beta * sum_t m_it KL_it. ``returns`` (B, T) is the critic target
    for ``gae`` and None otherwise. ``eps`` is GRPO's std epsilon; the REINFORCE++ variance
    floor stays at its own 1e-8 default. ``stuck_push`` > 0 adds :func:`stuck_group_push`
    (judged on the outcome ``rewards``, before any KL penalty) to grpo, drgrpo and rloo.
    ``unbiased`` picks the sample std in grpo and the unbiased whitening in the REINFORCE++
    pair (``algorithm.std_estimator``). The REINFORCE++ pair whitens over everything passed
    in: pass the whole batch.
    """
    if name not in ADVANTAGES:
        raise ValueError(f"unknown advantage {name!r}; valid: {', '.join(sorted(ADVANTAGES))}")
    if stuck_push and name not in ("grpo", "drgrpo", "rloo"):
        raise ValueError(f"stuck_push works on the group estimators grpo, drgrpo and rloo, not {name!r}")
    rewards = _as_float(rewards)
    kl_kw = {"token_kl": token_kl, "kl_coef": kl_coef, "gamma": gamma, "unbiased": unbiased}
    if name == "reinforce_pp":
        return reinforce_pp_advantages(rewards, mask, **kl_kw), None
    if name == "reinforce_pp_baseline":
        return reinforce_pp_baseline_advantages(rewards, mask, group_size, **kl_kw), None
    penalty = torch.zeros_like(mask, dtype=rewards.dtype)
    if token_kl is not None and kl_coef:
        penalty = -kl_coef * token_kl.detach().to(rewards.dtype) * mask.to(rewards.dtype)
    if name == "gae":
        if values is None:
            raise ValueError("advantage 'gae' needs values (B, T) from the critic")
        token_rewards = outcome_to_token_rewards(rewards, mask) + penalty
        return gae_advantages(token_rewards, values, mask, gamma=gamma, lam=lam)
    seq_rewards = rewards + penalty.sum(dim=-1)
    if name == "grpo":
        seq_adv = grpo_advantages(seq_rewards, group_size, eps=eps, unbiased=unbiased)
    elif name == "drgrpo":
        seq_adv = drgrpo_advantages(seq_rewards, group_size)
    else:
        seq_adv = rloo_advantages(seq_rewards, group_size)
    if stuck_push:
        seq_adv = seq_adv + stuck_group_push(rewards, group_size, stuck_push)
    return broadcast_to_tokens(seq_adv, mask), None
