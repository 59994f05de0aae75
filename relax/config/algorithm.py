"""The algorithm section of the config (``algorithm``): advantage, loss, KL, corrections, distillation.

Beside it, the checks that read only this section: an option the chosen estimator or loss would
not read is refused, not ignored.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from relax.config.fields import ConfigError, opt


@dataclass
class AlgorithmConfig:
    """Advantage estimator, policy loss and corrections (docs/algorithms.md)."""

    advantage: str = opt("grpo", "Advantage estimator.",
                         choices=("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae"))
    policy_loss: str = opt("ppo", "Policy loss.", choices=("ppo", "dual_clip", "gspo", "gspo_token", "cispo"))
    clip_low: float = opt(0.2, "PPO ratio clip below 1 (epsilon_low).", range=(0.0, 1.0))
    clip_high: float = opt(0.28, "PPO ratio clip above 1 (epsilon_high; DAPO clip-higher).", range=(0.0, 10.0))
    dual_clip_c: float = opt(3.0, "Dual-clip constant c (> 1).", range=(1.0, 100.0))
    loss_agg: str = opt("token-mean", "How token losses are averaged (docs/algorithms.md).",
                        choices=("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"))
    loss_agg_norm: int = opt(
        0,
        "The constant token count that loss_agg=seq-mean-token-sum-norm divides each sequence's "
        "loss sum by; 0 = rollout.max_new_tokens.",
        range=(0, 1_048_576),
    )
    std_estimator: str = opt("population", "Variance in GRPO's group std and in the batch whitening of REINFORCE++ "
                             "and GAE: population (divide by N) or unbiased (N - 1 and rsqrt(var + 1e-8), as verl).",
                             choices=("population", "unbiased"))
    gspo_clamp: float = opt(0.0, "Upper bound on the log importance ratio of policy_loss gspo and gspo_token; 0 = "
                            "none, 10 = verl's.", range=(0.0, 100.0))
    kl_coef: float = opt(0.0, "Weight of the KL penalty against the reference policy; 0 disables the reference.",
                         range=(0.0, 100.0))
    kl_estimator: str = opt("k3", "KL estimator (docs/algorithms.md; abs is verl's |log ratio|).",
                            choices=("k1", "k2", "k3", "abs"))
    kl_clamp: float = opt(
        0.0,
        "Bound on each sampled token's kl_estimator value, in the actor's loss and in the reward "
        "penalty: a token beyond it adds no KL gradient (docs/algorithms.md). 0 = no bound; 10 is "
        "verl's low_var_kl bound.",
        range=(0.0, 1e6),
    )
    kl_topk: int = opt(0, "k > 0: the actor's KL term is the forward KL[pi_ref || pi_theta] computed exactly over the "
                       "reference's k most likely tokens at every response position (docs/algorithms.md); 0 = "
                       "kl_estimator on the sampled tokens. Needs kl_in_reward=false.", range=(0, 1_000_000))
    kl_topk_weight: float = opt(1.0, "With kl_topk > 0: the share w of kl_coef on the top-k forward KL; the rest, "
                                "(1 - w) * kl_coef, stays on kl_estimator over the sampled tokens (ref_logprobs). "
                                "1 = the top-k term alone.", range=(0.0, 1.0))
    kl_in_reward: bool = opt(False, "Apply the KL as a per-token reward penalty -kl_coef * KL_t (computed by the "
                             "advantage role against policy version 0) instead of a loss term in the actor.")
    reference_role: bool = opt(False, "Score the reference policy (version 0) in a role of its own that commits "
                               "ref_logprobs (and with kl_topk its top-k columns) to the queue; false = the role that "
                               "needs the reference holds a copy. Needs kl_coef > 0.")
    mode: str = opt("rl", "rl: advantages from the reward (plus distill_coef's term); distill: on-policy distillation "
                    "alone, the advantage is the distill term and the reward is only reported (docs/algorithms.md).",
                    choices=("rl", "distill"))
    distill_coef: float = opt(0.0, "Weight c of on-policy distillation: each sampled token's advantage gains "
                              "c * (teacher logp - behaviour logp), the negative reverse KL to the teacher section's "
                              "model; 0 = off.", range=(0.0, 100.0))
    distill_topk: int = opt(0, "k > 0: the teacher also commits its k likeliest tokens at every trained position and "
                            "the actor adds distill_coef * the forward KL[pi_teacher || pi_theta] exact over them "
                            "(docs/algorithms.md); 0 = the sampled-token advantage alone.", range=(0, 1_000_000))
    entropy_coef: float = opt(0.0, "Entropy bonus weight.", range=(0.0, 10.0))
    turn_reward_coef: float = opt(
        0.0, "Weight c of the turn rewards external agents post (docs/agents.md): each token of policy turn k gains "
        "c * r_k in its advantage; 0 = turn rewards are recorded only.", range=(0.0, 100.0))
    near_miss_credit: float = opt(
        0.0, "Training reward for a count one away from the truth in the kinds of question a built-in task marks "
        "ordinal (docs/algorithms.md); 0 = exact match only. Held-out evaluation always scores exact match; not with "
        "data.reward_fn or data.judge_url.", range=(0.0, 0.99))
    stuck_group_push: float = opt(
        0.0, "beta of the push on prompt groups whose rewards are all equal and below 1: each of their samples gets "
        "advantage -beta * (1 - r) (docs/algorithms.md); 0 = plain GRPO. Advantage grpo, drgrpo or rloo, rewards on "
        "the 0..1 scale of the built-in verifiers.", range=(0.0, 10.0))
    routing_replay: bool = opt(False, "MoE models: train with the experts the rollout engine routed each token to "
                               "(R3, docs/algorithms.md) instead of the router's own top-k, so the importance ratio "
                               "sees no routing noise.")
    off_policy: str = opt("decoupled", "Correction for stale or engine-mismatched samples; none takes the PPO ratio "
                          "against the engine's log-probs, recompute against the trainer's own (verl, slime).",
                          choices=("none", "recompute", "decoupled", "tis", "icepop"))
    is_cap: float = opt(2.0, "Importance-weight bound: TIS truncates weights at it; icepop and decoupled drop tokens "
                          "beyond it (decoupled: pi_prox / pi_behav > is_cap, AReaL's behav_imp_weight_cap).",
                          range=(1.0, 1000.0))
    is_level: str = opt("token", "What tis and icepop weigh: each token by its own ratio, or each sequence by the "
                        "product of its tokens' ratios.", choices=("token", "sequence"))
    overlong_buffer: int = opt(0, "DAPO's soft overlong penalty: over the last this many tokens before "
                               "rollout.max_new_tokens the reward falls linearly by up to overlong_penalty; 0 = off.",
                               range=(0, 1_048_576))
    overlong_penalty: float = opt(1.0, "The overlong penalty at the length limit (DAPO's penalty_factor).",
                                  range=(0.0, 100.0))
    gamma: float = opt(1.0, "Discount of the returns, with advantage gae or reinforce_pp (verl's "
                       "algorithm.gamma); refused elsewhere, reinforce_pp_baseline included, which verl never "
                       "discounts.", range=(0.0, 1.0))
    lam: float = opt(0.95, "GAE lambda.", range=(0.0, 1.0))
    value_clip: float = opt(0.2, "PPO value clip eps of the critic's loss: a value moves at most this far from "
                            "the one GAE used before its squared error stops pulling; 0 = plain squared error. "
                            "Used with advantage=gae.", range=(0.0, 1000.0))


def check_turn_rewards(cfg: Any) -> None:
    """Only external agents post turn rewards; training on them elsewhere would silently do nothing."""
    a = cfg.algorithm
    if a.turn_reward_coef and (cfg.rollout.agents != "external" or a.mode != "rl"):
        raise ConfigError(f"algorithm.turn_reward_coef={a.turn_reward_coef:g} trains on the turn rewards external "
                          f"agents post: it needs rollout.agents=external and algorithm.mode=rl (set them, or "
                          f"turn_reward_coef=0)")


def check_reference_role(cfg: Any) -> None:
    if cfg.algorithm.reference_role and cfg.algorithm.kl_coef == 0:
        raise ConfigError("algorithm.reference_role=true scores a reference nobody uses: set algorithm.kl_coef > 0 "
                          "or reference_role=false")


def check_conventions(cfg: Any) -> None:
    """An algorithm option that the chosen estimator or loss would not read is refused, not ignored."""
    a = cfg.algorithm
    unused = [
        (a.is_level != "token", "is_level", a.is_level, "off_policy tis or icepop", a.off_policy in ("tis", "icepop")),
        (a.std_estimator != "population", "std_estimator", a.std_estimator,
         "advantage grpo, reinforce_pp, reinforce_pp_baseline or gae",
         a.advantage in ("grpo", "reinforce_pp", "reinforce_pp_baseline", "gae")),
        (a.gspo_clamp > 0, "gspo_clamp", a.gspo_clamp, "policy_loss gspo or gspo_token",
         a.policy_loss in ("gspo", "gspo_token")),
        (a.loss_agg_norm > 0, "loss_agg_norm", a.loss_agg_norm, "loss_agg seq-mean-token-sum-norm",
         a.loss_agg == "seq-mean-token-sum-norm"),
        (a.overlong_penalty != 1.0, "overlong_penalty", a.overlong_penalty, "overlong_buffer > 0",
         a.overlong_buffer > 0),
        (a.kl_estimator != "k3", "kl_estimator", a.kl_estimator, "kl_coef > 0", a.kl_coef > 0),
        (a.kl_clamp > 0, "kl_clamp", a.kl_clamp, "kl_coef > 0", a.kl_coef > 0),
        (a.kl_in_reward, "kl_in_reward", a.kl_in_reward, "kl_coef > 0", a.kl_coef > 0),
        (a.dual_clip_c != 3.0, "dual_clip_c", a.dual_clip_c, "policy_loss dual_clip", a.policy_loss == "dual_clip"),
        (a.is_cap != 2.0, "is_cap", a.is_cap, "off_policy decoupled, tis or icepop",
         a.off_policy in ("decoupled", "tis", "icepop")),
        # verl's reinforce_plus_plus_baseline spreads r - mean over the tokens undiscounted: refused there
        (a.gamma != 1.0, "gamma", a.gamma, "advantage gae or reinforce_pp", a.advantage in ("gae", "reinforce_pp")),
        (a.lam != 0.95, "lam", a.lam, "advantage gae", a.advantage == "gae"),
        (a.value_clip != 0.2, "value_clip", a.value_clip, "advantage gae (the critic)", a.advantage == "gae"),
    ]
    for set_, name, value, needs, used in unused:
        if set_ and not used:
            raise ConfigError(f"algorithm.{name}={value} is read only with {needs}: it would change nothing here; "
                              f"remove it or choose one of those")


def check_stuck_group_push(cfg: Any) -> None:
    a = cfg.algorithm
    if a.stuck_group_push and a.advantage not in ("grpo", "drgrpo", "rloo"):
        raise ConfigError(f"algorithm.stuck_group_push adds to a group estimator's advantage (grpo, drgrpo, rloo), "
                          f"not {a.advantage!r}: set it to 0 or change algorithm.advantage")


def check_kl_topk(cfg: Any) -> None:
    """The top-k KL is a loss term of its own, weighted against kl_estimator by kl_topk_weight."""
    a = cfg.algorithm
    if a.kl_topk and (a.kl_coef == 0 or a.kl_in_reward):
        raise ConfigError("algorithm.kl_topk is the actor's KL loss term: it needs algorithm.kl_coef > 0 and "
                          "kl_in_reward=false (a reward penalty sees only the sampled tokens); set kl_topk=0 or "
                          "change those")
    if a.kl_topk_weight != 1.0 and not a.kl_topk:
        raise ConfigError("algorithm.kl_topk_weight splits the KL between the top-k term and kl_estimator: it needs "
                          "algorithm.kl_topk > 0; set kl_topk or leave kl_topk_weight at 1")
    if a.kl_topk and a.kl_topk_weight == 0:
        raise ConfigError("algorithm.kl_topk_weight=0 puts no weight on the top-k KL the reference would still "
                          "score: set algorithm.kl_topk=0 for kl_estimator alone")
