"""Pure tensor math of RL post-training: advantages, policy losses, loss aggregation, KL and
entropy, off-policy corrections, DAPO's sample filters and the critic's value loss.

Pure torch: nothing here imports Ray, Flyte, fsspec or any other part of ``relax``, so the
same functions run in the advantage service, the actor, a notebook and the tests. Shapes:
B sequences, T tokens, G group size; masks are float/bool (B, T) with 1 on response tokens;
every loss is to be MINIMISED. Formulas and papers: docs/algorithms.md.

The registries map the names accepted by :class:`relax.config.AlgorithmConfig` to
functions; :func:`lookup` resolves one by config field and name. The ``compute_*`` /
``aggregate_loss`` / ``off_policy_correction`` dispatchers take the same names with one
uniform signature per kind.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from relax.algorithms.advantages import (
    ADVANTAGES,
    broadcast_to_tokens,
    compute_advantages,
    drgrpo_advantages,
    gae_advantages,
    grpo_advantages,
    outcome_to_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    stuck_group_push,
    stuck_groups,
)
from relax.algorithms.aggregation import (
    LOSS_AGG,
    aggregate_loss,
    masked_max,
    masked_mean,
    masked_sum,
    masked_whiten,
    seq_mean_token_mean,
    seq_mean_token_sum,
    seq_mean_token_sum_norm,
    token_mean,
)
from relax.algorithms.dapo import (
    dynamic_sampling_filter,
    dynamic_sampling_stats,
    overlong_filter,
    overlong_penalty,
)
from relax.algorithms.kl import (
    KL_ESTIMATORS,
    entropy_bonus,
    entropy_from_logits,
    kl_abs,
    kl_estimate,
    kl_k1,
    kl_k2,
    kl_k3,
    kl_loss,
    kl_reward_penalty,
    token_kl,
    topk_forward_kl,
)
from relax.algorithms.losses import (
    POLICY_LOSSES,
    cispo_loss,
    compute_policy_loss,
    dual_clip_loss,
    gspo_loss,
    gspo_token_loss,
    ppo_loss,
)
from relax.algorithms.off_policy import (
    OFF_POLICY,
    Correction,
    decoupled_ppo_loss,
    decoupled_weights,
    icepop,
    no_correction,
    off_policy_correction,
    tis_weights,
)
from relax.algorithms.value import clipped_value_loss, value_loss

#: ``AlgorithmConfig.kl_estimator`` names -> estimator f(logprobs, ref_logprobs) -> (B, T).
KL = KL_ESTIMATORS

#: Registry per ``AlgorithmConfig`` field; :func:`lookup` searches these.
REGISTRIES: dict[str, Mapping[str, Callable[..., Any]]] = {
    "advantage": ADVANTAGES,
    "policy_loss": POLICY_LOSSES,
    "loss_agg": LOSS_AGG,
    "kl_estimator": KL,
    "off_policy": OFF_POLICY,
}


def lookup(kind: str, name: str) -> Callable[..., Any]:
    """The function registered as ``name`` for config field ``kind``, e.g.
    ``lookup("policy_loss", cfg.algorithm.policy_loss)``.

    Raises ValueError naming the unknown name (or kind) and the valid ones.
    """
    if kind not in REGISTRIES:
        raise ValueError(f"unknown algorithm registry {kind!r}; valid: {', '.join(sorted(REGISTRIES))}")
    registry = REGISTRIES[kind]
    if name not in registry:
        raise ValueError(f"unknown {kind} {name!r}; valid: {', '.join(sorted(registry))}")
    return registry[name]


__all__ = [
    "ADVANTAGES",
    "KL",
    "KL_ESTIMATORS",
    "LOSS_AGG",
    "OFF_POLICY",
    "POLICY_LOSSES",
    "REGISTRIES",
    "Correction",
    "aggregate_loss",
    "broadcast_to_tokens",
    "cispo_loss",
    "clipped_value_loss",
    "compute_advantages",
    "compute_policy_loss",
    "decoupled_ppo_loss",
    "decoupled_weights",
    "drgrpo_advantages",
    "dual_clip_loss",
    "dynamic_sampling_filter",
    "dynamic_sampling_stats",
    "entropy_bonus",
    "entropy_from_logits",
    "gae_advantages",
    "grpo_advantages",
    "gspo_loss",
    "gspo_token_loss",
    "icepop",
    "kl_abs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_reward_penalty",
    "lookup",
    "masked_max",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "no_correction",
    "off_policy_correction",
    "outcome_to_token_rewards",
    "overlong_filter",
    "overlong_penalty",
    "ppo_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
    "stuck_group_push",
    "stuck_groups",
    "tis_weights",
    "token_kl",
    "topk_forward_kl",
    "token_mean",
    "value_loss",
]
