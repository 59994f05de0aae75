"""The actor's exact top-k KL to the teacher (``algorithm.distill_topk``), on a tiny Qwen2."""

from __future__ import annotations

import copy

import pytest
import torch
from tiny import VOCAB, actor, full_logprobs, on_policy, tiny_qwen2

from relax.config import ConfigError, load_config
from relax.trainers.torch.actor import Reference

TEACHER = ["algorithm.distill_coef=0.5", "teacher.name_or_path=tiny-qwen2", "algorithm.off_policy=none"]


def _moved(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy of ``model`` with every weight moved by 0.05 x N(0, 1): a policy that is not the teacher."""
    out, gen = copy.deepcopy(model), torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in out.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return out


def test_topk_over_the_whole_vocabulary_is_the_exact_forward_kl_to_the_teacher():
    teacher = tiny_qwen2()
    a = actor(*TEACHER, f"algorithm.distill_topk={VOCAB}", model=_moved(teacher, 0))
    batch = on_policy(a)
    with pytest.raises(ValueError, match=r"needs batch field\(s\) \['teacher_topk_ids', 'teacher_topk_logprobs'\]"):
        a.train_step(batch)
    batch.teacher_topk_ids, batch.teacher_topk_logprobs, _ = Reference(teacher).topk(batch, VOCAB)
    # token mean over the response tokens of sum_v p_T(v) (log p_T(v) - log p_theta(v)), from both full softmaxes
    kl = [((t.exp() * (t - q)).sum(-1) * m).sum() for t, q, m in
          zip(full_logprobs(teacher, batch), full_logprobs(a.model, batch), batch.loss_mask, strict=True)]
    want = float(sum(kl) / sum(m.sum() for m in batch.loss_mask))
    assert want > 1e-3
    result = a.train_step(batch)
    assert result.metrics["distill_topk_kl"] == pytest.approx(want, rel=1e-4)
    # on policy the PPO part is -18/38 (test_actor), so the loss is that plus distill_coef x the KL
    assert result.loss == pytest.approx(-18 / 38 + 0.5 * want, abs=1e-5)


def test_reference_and_teacher_terms_add_up():
    # loss = pg + c_kl * KL_ref + c_d * KL_teacher: linear in each term, so with both on it is the sum of
    # each alone minus the shared pg part: L(both) = L(ref) + L(teacher) - L(neither)
    policy = tiny_qwen2()
    teacher, ref = _moved(policy, 1), _moved(policy, 2)
    batch = on_policy(actor(model=copy.deepcopy(policy)))
    batch.ref_topk_ids, batch.ref_topk_logprobs, _ = Reference(ref).topk(batch, 8)
    batch.teacher_topk_ids, batch.teacher_topk_logprobs, _ = Reference(teacher).topk(batch, 8)
    runs = {"both": ("algorithm.kl_coef=0.3", "algorithm.kl_topk=8", *TEACHER, "algorithm.distill_topk=8"),
            "ref": ("algorithm.kl_coef=0.3", "algorithm.kl_topk=8", "algorithm.off_policy=none"),
            "teacher": (*TEACHER, "algorithm.distill_topk=8"), "neither": ("algorithm.off_policy=none",)}
    losses = {name: actor(*o, model=copy.deepcopy(policy)).train_step(batch).loss for name, o in runs.items()}
    assert min(abs(losses["ref"] - losses["neither"]), abs(losses["teacher"] - losses["neither"])) > 1e-3
    assert losses["both"] == pytest.approx(losses["ref"] + losses["teacher"] - losses["neither"], abs=1e-6)


def test_distill_topk_needs_a_distill_coef():
    with pytest.raises(ConfigError, match=r"algorithm.distill_topk=8 .* algorithm.distill_coef, which is 0"):
        load_config(None, ["algorithm.distill_topk=8"])
