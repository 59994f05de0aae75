"""On-policy distillation's per-token advantage, derived by hand on three-element tensors."""

from __future__ import annotations

import pytest
import torch

from relax.algorithms.distill import distill_advantages, reverse_kl_estimate

BEHAV = torch.tensor([-1.0, -2.0, -0.5])
TEACHER = torch.tensor([-0.5, -3.0, -0.5])
MASK = torch.tensor([0.0, 1.0, 1.0])


def test_the_advantage_is_the_negative_sampled_reverse_kl_on_the_mask():
    # coef * (teacher - behaviour) * mask = 2 * (0.5, -1, 0) * (0, 1, 1) = (0, -2, 0)
    assert distill_advantages(BEHAV, TEACHER, MASK, coef=2.0).tolist() == [0.0, -2.0, 0.0]
    # the sampled reverse KL over the masked tokens: ((-2 - -3) + (-0.5 - -0.5)) / 2 = 0.5
    assert float(reverse_kl_estimate(BEHAV, TEACHER, MASK)) == pytest.approx(0.5)
    # a student that matches the teacher gets no push at all
    assert distill_advantages(TEACHER, TEACHER, MASK).abs().sum() == 0


def test_a_step_along_the_advantage_lowers_the_reverse_kl():
    # one gradient step of -sum(A_t * log p(x_t)) on a 3-way softmax moves the sampled token toward the teacher
    teacher = torch.log_softmax(torch.tensor([2.0, 0.0, -1.0]), -1)
    logits = torch.zeros(3, requires_grad=True)
    for _ in range(50):
        logp = torch.log_softmax(logits, -1)
        token = torch.tensor([0, 1, 2])  # every token "sampled" once, weighted by the student's probability
        adv = distill_advantages(logp.detach()[token], teacher[token], torch.ones(3))
        loss = -(logp.exp().detach() * adv * logp[token]).sum()
        loss.backward()
        with torch.no_grad():
            logits -= 0.5 * logits.grad
        logits.grad = None
    student = torch.log_softmax(logits.detach(), -1)
    kl = float((student.exp() * (student - teacher)).sum())
    assert kl < 1e-3  # reverse KL(student || teacher) driven to ~0


def test_misaligned_tensors_are_refused_naming_the_shapes():
    with pytest.raises(ValueError, match=r"behaviour \(3,\), teacher \(2,\)"):
        distill_advantages(BEHAV, TEACHER[:2], MASK)
