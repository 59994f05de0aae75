"""On-policy distillation: the negative per-token reverse KL to a teacher, as the student's advantage.

The student samples, a teacher scores every sampled token, and the student's per-token
advantage is the negative reverse KL to the teacher.

For a sampled token x_t the single-sample estimate of the reverse KL
KL(pi_student || pi_teacher) at position t is log pi_student(x_t | x_<t) - log pi_teacher(x_t | x_<t),
with the student's probability taken from the behaviour policy that sampled it (the engine's
log-probs). Its negative, weighted by ``coef``, is a dense per-token advantage:

    A_t = coef * (log pi_teacher(x_t) - log pi_behav(x_t)) * m_t          (B, T)

trained with the policy-gradient loss the run already uses (the importance ratio, clipping and
off-policy corrections apply unchanged). Minimising the expected reverse KL this way is the
recipe of Thinking Machines' "On-Policy Distillation" (Lu et al. 2025, per-token reverse KL as the
advantage, no discount) and of slime's on-policy distillation; the objective is GKD's on-policy
reverse-KL case (Agarwal et al. 2024, "On-Policy Distillation of Language Models: Learning from
Self-Generated Mistakes", ICLR, arXiv:2306.13649). With ``algorithm.mode=rl`` the term is added to
the reward's advantages; with ``mode=distill`` it is the whole advantage.
"""

from __future__ import annotations

import torch


def distill_advantages(behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor,
                       coef: float = 1.0) -> torch.Tensor:
    """Per-token distillation advantages (any shape, e.g. (T,) or (B, T)): ``coef * (teacher - behaviour)``
    on the mask, 0 elsewhere (the module docstring's A_t).

    E.g. behaviour (-1, -2, -0.5), teacher (-0.5, -3, -0.5), mask (0, 1, 1), coef 2:
    2 * (0.5, -1, 0) * (0, 1, 1) = (0, -2, 0): the prompt position is masked, the token the teacher finds
    less likely than the student did is pushed down, the one they agree on is left alone."""
    if behaviour_logprobs.shape != teacher_logprobs.shape or mask.shape != behaviour_logprobs.shape:
        raise ValueError(f"distillation needs aligned per-token tensors: behaviour {tuple(behaviour_logprobs.shape)}, "
                         f"teacher {tuple(teacher_logprobs.shape)}, mask {tuple(mask.shape)}")
    m = mask.to(behaviour_logprobs.dtype)
    return coef * (teacher_logprobs.to(behaviour_logprobs.dtype) - behaviour_logprobs) * m


def reverse_kl_estimate(behaviour_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor,
                        mask: torch.Tensor) -> torch.Tensor:
    """Mean over the masked tokens of log pi_behav - log pi_teacher: the sampled reverse KL (a scalar),
    what distillation drives down. E.g. the example above: ((-2 + 3) + (-0.5 + 0.5)) / 2 = 0.5."""
    m = mask.to(behaviour_logprobs.dtype)
    return ((behaviour_logprobs - teacher_logprobs.to(behaviour_logprobs.dtype)) * m).sum() / m.sum().clamp(min=1)
