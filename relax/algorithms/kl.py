"""KL regularisation against a reference policy, and the entropy of the policy.

KL estimators follow J. Schulman, "Approximating KL Divergence" (2020),
http://joschu.net/blog/kl-approx.html. Tokens are sampled from the policy q = pi_theta and
we want KL[q || p] with p = pi_ref. With log rho = log p(x) - log q(x) = ref_logprob -
logprob:

* k1 = -log rho                  unbiased, high variance, can be negative per token;
* k2 = (log rho)^2 / 2           biased (second order), low variance, >= 0;
* k3 = (rho - 1) - log rho       unbiased, low variance, >= 0 (verl's "low_var_kl");
* abs = |log rho|                verl's "abs": biased, >= 0, a gradient of constant size.

With ``AlgorithmConfig.kl_topk = k`` the actor instead computes the forward KL[pi_ref || pi_theta]
exactly over the reference's k most likely tokens at every response position
(:func:`topk_forward_kl`). In expectation k3's gradient on on-policy samples is that same
forward KL's, q - p in the logits, but a token the policy no longer samples receives its
share only on the rare step that samples it, as one large kick that gradient clipping and
Adam's second moment mostly absorb. The exact sum gives every such token its p every step.

The KL enters training in one of two ways (``AlgorithmConfig.kl_in_reward``):
as a differentiable loss term (:func:`kl_loss`, scaled by ``kl_coef`` after aggregation)
or as per-token reward shaping (:func:`token_kl` handed to
``compute_advantages(token_kl=..., kl_coef=...)``, or :func:`kl_reward_penalty`; no gradient).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from relax.algorithms.aggregation import aggregate_loss

__all__ = [
    "KL_ESTIMATORS",
    "entropy_bonus",
    "entropy_from_logits",
    "kl_abs",
    "kl_estimate",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_loss",
    "kl_reward_penalty",
    "token_kl",
    "topk_forward_kl",
]

# exp(20) ~ 5e8: far beyond any ratio a sane run sees, small enough that k3 stays finite.
_MAX_LOG_RHO = 20.0


def _log_rho(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return (ref_logprobs.detach() - logprobs).clamp(-_MAX_LOG_RHO, _MAX_LOG_RHO)


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = log q - log p = logprob - ref_logprob (config ``k1``). Shapes: (B, T) -> (B, T)."""
    return -_log_rho(logprobs, ref_logprobs)


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = (log p - log q)^2 / 2 (config ``k2``). Its gradient is that of the true KL to
    first order around q = p. Shapes: (B, T) -> (B, T)."""
    return 0.5 * _log_rho(logprobs, ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k3 = (p/q - 1) - log(p/q) (config ``k3``); expm1 keeps precision when p ~ q.
    Shapes: (B, T) -> (B, T)."""
    log_rho = _log_rho(logprobs, ref_logprobs)
    return torch.expm1(log_rho) - log_rho


def kl_abs(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """abs = |log q - log p| (config ``abs``, verl's ``kl_penalty=abs``). Not an unbiased KL
    estimate; its gradient in log q is sign(log q - log p), the same size for every token.
    Shapes: (B, T) -> (B, T)."""
    return _log_rho(logprobs, ref_logprobs).abs()


#: Config name (``AlgorithmConfig.kl_estimator``) -> estimator f(logprobs, ref_logprobs).
KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3,
                                                                "abs": kl_abs}


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: str = "k3", clamp: float = 0.0) -> Tensor:
    """Per-token estimate of KL[pi_theta || pi_ref] with the named estimator (k1/k2/k3/abs).

    ``clamp`` > 0 bounds each token's estimate to [-clamp, clamp] (``AlgorithmConfig.kl_clamp``);
    a token beyond the bound adds no gradient. Why: k3's gradient in log q is 1 - rho, so a sampled
    token the policy has learned to avoid (q << p) carries a gradient of about p/q, up to exp(20),
    which global-norm clipping then turns into the whole step's direction. verl's
    ``low_var_kl`` bounds k3 at 10 the same way.

    Shapes: logprobs, ref_logprobs (B, T) -> (B, T), unmasked. Gradient flows through
    ``logprobs`` only. Raises ValueError for an unknown ``estimator``.
    """
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown kl_estimator {estimator!r}; valid: {', '.join(sorted(KL_ESTIMATORS))}")
    kl = KL_ESTIMATORS[estimator](logprobs, ref_logprobs)
    return kl.clamp(-clamp, clamp) if clamp > 0 else kl


def kl_loss(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k3",
            clamp: float = 0.0) -> Tensor:
    """KL as a loss term (``kl_in_reward = False``): per-token KL, 0 off the mask.

    Formula: l_t = m_t * clip(k(logp_t, logp_ref_t), -clamp, clamp) (no clip at clamp = 0); the
    trainer adds kl_coef * aggregate(l, mask). Shapes: (B, T) -> (B, T).
    """
    kl = kl_estimate(logprobs, ref_logprobs, estimator, clamp)
    m = mask.to(kl.dtype)
    return torch.where(m > 0, kl * m, torch.zeros_like(kl))


def token_kl(logprobs: Tensor, ref_logprobs: Tensor, mask: Tensor, estimator: str = "k1",
             clamp: float = 0.0) -> Tensor:
    """Per-token KL of the *sampling* policy to the reference, as a constant (``kl_in_reward``).

    Formula: KL_t = m_t * k(logp_t, logp_ref_t), detached: the advantage role computes it
    from a row's behaviour log-probs and hands it to
    :func:`relax.algorithms.advantages.compute_advantages` as ``token_kl``. Off the mask
    (prompt, tool output, padding) it is exactly 0, whatever the log-probs hold there.
    Shapes: (B, T) -> (B, T).
    """
    kl = kl_estimate(logprobs.detach(), ref_logprobs, estimator, clamp)
    m = mask.to(kl.dtype)
    return torch.where(m > 0, kl * m, torch.zeros_like(kl))


def kl_reward_penalty(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    mask: Tensor,
    kl_coef: float,
    estimator: str = "k1",
) -> Tensor:
    """KL as per-token reward shaping (``kl_in_reward = True``; InstructGPT-style,
    arXiv:2203.02155): R_t += -beta * k(logp_t, logp_ref_t) * m_t.

    ``logprobs`` are the sampling (old) policy's, so the penalty is a constant reward
    (detached). k1 is the classic choice here: its expectation is the KL and the sum over
    tokens is the sequence log-ratio. Shapes: (B, T) -> (B, T) penalty (<= 0 for k2/k3).
    """
    return -kl_coef * token_kl(logprobs, ref_logprobs, mask, estimator)


def topk_forward_kl(logprobs_k: Tensor, ref_logprobs_k: Tensor, mask: Tensor) -> Tensor:
    """Forward KL[pi_ref || pi_theta] summed over the reference's top-k tokens (config ``kl_topk``).

    Formula: KL_t = m_t * sum_j p_tj (log p_tj - log q_tj), with p_tj = exp(ref_logprobs_k[t, j])
    the reference's probability of its j-th most likely token at position t and
    log q_tj = logprobs_k[t, j] the policy's log-probability of that token. Its gradient in the
    policy's logits z_t is P_t q_t - p_t (P_t = sum_j p_tj; p_t zero off the top k): every top-k
    token is pulled up by its reference probability, sampled or not. With k = V it is the exact
    forward KL. Shapes: logprobs_k, ref_logprobs_k (B, T, k), mask (B, T) -> (B, T), 0 off the
    mask. Gradient flows through ``logprobs_k`` only.
    """
    ref = ref_logprobs_k.detach()
    per_token = (ref.exp() * (ref - logprobs_k)).sum(-1)
    m = mask.to(per_token.dtype)
    return torch.where(m > 0, per_token * m, torch.zeros_like(per_token))


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at every position.

    Formula: H = -sum_v p_v log p_v with log p = log_softmax(z) (computed as z - logsumexp z,
    so large logits do not overflow). Vocabulary entries masked with -inf logits have p = 0
    and contribute exactly 0 to the value and the gradient (no 0 * -inf NaN).
    Shapes: logits (B, T, V) -> (B, T), in the logits' dtype.
    """
    logp = torch.log_softmax(logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits, -1)
    p = logp.exp()
    safe_logp = torch.where(p > 0, logp, torch.zeros_like(logp))
    return (-(p * safe_logp).sum(dim=-1)).to(logits.dtype)


def entropy_bonus(entropy: Tensor, mask: Tensor, coef: float, mode: str = "token-mean") -> Tensor:
    """Entropy bonus as a loss term to ADD to the policy loss (config ``entropy_coef``).

    Formula: L_ent = -coef * aggregate(H, mask) -- negative because the loss is minimised
    and higher entropy is rewarded. Shapes: entropy, mask (B, T) -> scalar.
    """
    return -coef * aggregate_loss(entropy, mask, mode)
