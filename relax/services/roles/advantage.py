"""The advantage role: complete prompt groups in, per-token advantages out (a new column).

It is the consumer group ``advantage`` of the ``rollouts`` topic: each step takes
``prompts_per_step`` complete groups, computes the configured estimator (eq. refs in
relax.algorithms.advantages) and commits the ``advantages`` field for those samples. GRPO,
Dr.GRPO and RLOO normalise per prompt group; REINFORCE++ and REINFORCE++-baseline whiten over
the whole step's response tokens (their baseline is the batch, not the group). With
``algorithm.overlong_buffer`` DAPO's soft length penalty joins the reward first. A sample whose reward failed (``error``
set) has an
all-zero loss mask, so its advantage is zero everywhere and it trains with zero weight.

With ``advantage=gae`` (PPO with a critic) a group is complete only once the critic role
(relax.services.roles.critic) has committed its ``values``; the step computes GAE over the whole
batch, whitens the advantages over the batch's response tokens (PPO's usual normalisation;
GAE on a sparse outcome reward is otherwise scaled by the reward rate) and commits both
``advantages`` and ``returns`` (A + V before whitening: the critic's regression target).

With ``algorithm.kl_in_reward`` (and ``kl_coef`` = beta > 0) the KL to the reference policy
is a reward, not a loss term: this role holds the reference (a frozen policy version 0, as
the actor does for the loss term), scores each row's tokens with it, takes
KL_t = k(logp_t, logp_ref_t) on the loss mask from the row's behaviour ``logprobs``, and
hands it to the estimator (token-level ones: R_t = r * 1[t = last] - beta * KL_t;
group/sequence ones: r_i - beta * sum_t KL_it before the group baseline; docs/algorithms.md).
The KL then reaches the actor only through ``advantages``; its mean is in this role's metrics.

With ``algorithm.distill_coef`` (on-policy distillation) the teacher role's ``teacher_logprobs``
join: each trained token's advantage gains ``c * (teacher logp - behaviour logp)``
(relax.algorithms.distill), and with ``algorithm.mode=distill`` that term is the whole advantage.

A crash between recording a step and committing its advantages is repaired at start:
recorded steps whose samples still lack the field are computed again (same inputs, same
output), so no group is ever left without advantages.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from relax.algorithms import compute_advantages, masked_whiten, overlong_penalty, stuck_groups, token_kl
from relax.algorithms.distill import distill_advantages, reverse_kl_estimate
from relax.algorithms.turn_rewards import turn_advantages
from relax.services.queue_contract import ADVANTAGE_FIELDS, ADVANTAGE_GROUP, RETURN_FIELDS
from relax.services.roles.column import ColumnStage
from relax.services.roles.media import MediaInputs, effective_masks, to_rollout_batch
from relax.services.run_context import RunContext
from relax.transfer.consumer import Batch

PER_GROUP = ("grpo", "drgrpo", "rloo")
BATCH_WHITENED = ("reinforce_pp", "reinforce_pp_baseline")
SEQUENCE_LEVEL = PER_GROUP + BATCH_WHITENED


def _padded(rows: list[np.ndarray]) -> torch.Tensor:
    """B arrays (L_i,) -> (B, max L) float32, zero-padded on the right."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(r.astype(np.float32))
    return out


def _padded_or_none(rows: list[np.ndarray] | None) -> torch.Tensor | None:
    return None if rows is None else _padded(rows)


def group_advantages(name: str, rewards: list[float], masks: list[np.ndarray], *,
                     kl: list[np.ndarray] | None = None, kl_coef: float = 0.0,
                     stuck_push: float = 0.0, unbiased: bool = False) -> list[np.ndarray]:
    """Advantages (L_i,) of one prompt group: ``rewards`` (G,), ``masks`` G arrays (L_i,);
    ``kl`` G arrays (L_i,) of per-token KL folded into the reward with weight ``kl_coef``;
    ``stuck_push``: ``algorithm.stuck_group_push``; ``unbiased``: ``std_estimator``."""
    adv, _ = compute_advantages(name, torch.tensor(rewards, dtype=torch.float32), _padded(masks),
                                group_size=len(masks), token_kl=_padded_or_none(kl), kl_coef=kl_coef,
                                stuck_push=stuck_push, unbiased=unbiased)
    return [adv[i, : len(m)].numpy().astype(np.float32) for i, m in enumerate(masks)]


def batch_whitened(name: str, rewards: list[float], masks: list[np.ndarray], groups: list[str], *,
                   kl: list[np.ndarray] | None = None, kl_coef: float = 0.0, gamma: float = 1.0,
                   unbiased: bool = False) -> list[np.ndarray]:
    """REINFORCE++ (-baseline) advantages (L_i,) of one step's batch, rows in any order:
    ``rewards`` (B,), ``masks`` and ``kl`` B arrays (L_i,), ``groups`` the rows' prompt groups;
    ``gamma`` discounts the returns (``algorithm.gamma``; the config allows it with reinforce_pp only).
    The whitening runs over all the batch's response tokens (arXiv:2501.03262, eq. 8); the
    baseline variant first subtracts each group's mean reward, so its groups are made contiguous."""
    members: dict[str, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    sizes = sorted({len(m) for m in members.values()})
    if name == "reinforce_pp_baseline" and len(sizes) > 1:
        raise ValueError(f"reinforce_pp_baseline needs prompt groups of one size in a step, got sizes {sizes}")
    order = [i for m in members.values() for i in m]
    adv, _ = compute_advantages(name, torch.tensor([rewards[i] for i in order], dtype=torch.float32),
                                _padded([masks[i] for i in order]), group_size=sizes[0],
                                token_kl=None if kl is None else _padded([kl[i] for i in order]), kl_coef=kl_coef,
                                gamma=gamma, unbiased=unbiased)
    out: list[np.ndarray] = [np.zeros(0, np.float32)] * len(order)
    for row, i in enumerate(order):
        out[i] = adv[row, : len(masks[i])].numpy().astype(np.float32)
    return out


def overlong_shaped(rewards: list[float], masks: list[np.ndarray], max_tokens: int, buffer: int,
                    factor: float) -> tuple[list[float], float]:
    """Rewards plus DAPO's soft overlong penalty (arXiv:2503.14476, eq. 13) on each row's
    response length (its loss-mask tokens), and the batch's mean penalty."""
    lengths = torch.tensor([float(np.sum(m)) for m in masks])
    penalty = overlong_penalty(lengths, max_tokens, buffer, factor)
    return [r + float(p) for r, p in zip(rewards, penalty, strict=True)], float(penalty.mean())


def advantage_stats(advs: list[np.ndarray], masks: list[np.ndarray]) -> dict[str, float]:
    """``adv_mean`` / ``adv_std``: mean and population std of the advantages over the batch's
    trained tokens (REINFORCE++ gives ~0 / ~1 by construction; a per-group estimator does not)."""
    picked = np.concatenate([a[np.asarray(m) > 0] for a, m in zip(advs, masks, strict=True)] + [np.zeros(0)])
    return {"adv_mean": float(picked.mean()), "adv_std": float(picked.std())} if picked.size else {}


def batch_gae(rewards: list[float], masks: list[np.ndarray], values: list[np.ndarray], *, gamma: float,
              lam: float, kl: list[np.ndarray] | None = None, kl_coef: float = 0.0,
              unbiased: bool = False) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """GAE of one batch: rewards (B,), masks and values B arrays (L_i,) -> per-sample
    (advantages whitened over the batch's masked tokens, returns), each (L_i,). ``kl`` as in
    :func:`group_advantages`: -kl_coef * KL_t joins the token rewards (and so the returns)."""
    mask, v = _padded(masks), _padded(values)
    adv, returns = compute_advantages("gae", torch.tensor(rewards, dtype=torch.float32), mask, values=v,
                                      gamma=gamma, lam=lam, token_kl=_padded_or_none(kl), kl_coef=kl_coef)
    adv = masked_whiten(adv, mask, unbiased=unbiased)
    return ([adv[i, : len(m)].numpy() for i, m in enumerate(masks)],
            [returns[i, : len(m)].numpy() for i, m in enumerate(masks)])


def rows_kl(logprobs: list[np.ndarray], ref_logprobs: list[torch.Tensor], masks: list[np.ndarray],
            estimator: str, clamp: float = 0.0) -> list[np.ndarray]:
    """Per-row (L_i,) KL_t = m_t * k(behaviour logp_t, reference logp_t), 0 off the mask."""
    out = []
    for lp, ref, m in zip(logprobs, ref_logprobs, masks, strict=True):
        # torch.tensor copies: shard arrays are read-only views
        kl = token_kl(torch.tensor(lp, dtype=torch.float32), ref.detach().float().cpu(),
                      torch.tensor(m, dtype=torch.float32), estimator, clamp)
        out.append(kl.numpy())
    return out


class AdvantageRole:
    def __init__(self, ctx: RunContext, writer_id: str = "advantage", wait_s: float | None = 600.0):
        alg = ctx.cfg.algorithm
        if alg.advantage not in (*SEQUENCE_LEVEL, "gae"):
            raise ValueError(f"algorithm.advantage={alg.advantage!r} is not run by the advantage role; choose one "
                             f"of {(*SEQUENCE_LEVEL, 'gae')}")
        self.name, self.alg = alg.advantage, alg
        self.max_new_tokens = ctx.cfg.rollout.max_new_tokens
        self.gae = alg.advantage == "gae"
        self.kl_in_reward = alg.kl_in_reward and alg.kl_coef > 0
        needs = ["reward", "loss_mask", "values"] if self.gae else ["reward", "loss_mask"]
        if ctx.cfg.data.reward_role:  # rows whose reward failed train with zero weight
            needs += ["error"]
        self.distill = alg.distill_coef > 0  # on-policy distillation: the teacher role's column joins
        if alg.turn_reward_coef > 0:  # each policy turn's posted reward on its tokens
            needs += ["turn_rewards"]
        if self.distill:
            needs += ["logprobs", "teacher_logprobs"]
        self.reference, self.media = None, None
        if self.kl_in_reward:
            from relax.services.roles.actor import (
                initial_reference,  # the actor's module: only this mode needs it
            )

            # the reference scores the row's tokens (and media) against its behaviour logprobs;
            # it is version 0, which the actor publishes (after any warm start) before its first step
            if alg.reference_role:  # the reference role scores the rows: read its column
                needs += ["logprobs", "ref_logprobs"]
            else:
                needs += ["tokens", "logprobs", "prompt_len", "turn_media"]
                self.reference, processor = initial_reference(ctx, wait_s)
                self.media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
        self.stage = ColumnStage(ctx, ADVANTAGE_GROUP, needs, writer_id,
                                 ADVANTAGE_FIELDS + (RETURN_FIELDS if self.gae else ()), "advantages")
        self.queue, self.consumer, self.producer = self.stage.queue, self.stage.consumer, self.stage.producer
        self.repaired = self.stage.repair(self._commit)

    def _token_kl(self, batch: Batch) -> list[np.ndarray]:
        """Per-row KL to the reference on the loss mask (the same for a recomputed step: the
        reference is frozen and the behaviour logprobs are the committed ones)."""
        f = batch.fields
        if self.reference is None:  # reference_role: the column is there
            ref = [torch.tensor(r, dtype=torch.float32) for r in f["ref_logprobs"]]
        else:
            ref = self.reference.logprobs(to_rollout_batch(batch, self.media))
        return rows_kl(f["logprobs"], ref, f["loss_mask"], self.alg.kl_estimator, self.alg.kl_clamp)

    def _commit(self, batch: Batch) -> dict[str, float]:
        """Compute and commit the batch's advantages; returns their metrics (KL ones with kl_in_reward)."""
        alg, masks = self.alg, batch.fields["loss_mask"]
        extra: dict[str, float] = {}
        rewards = [float(r) for r in batch.fields["reward"]]
        if alg.overlong_buffer:  # on the generated length, so before error rows lose their mask
            rewards, extra["overlong_penalty"] = overlong_shaped(rewards, masks, self.max_new_tokens,
                                                                 alg.overlong_buffer, alg.overlong_penalty)
        masks = batch.fields["loss_mask"] = effective_masks(masks, batch.fields.get("error"))
        kl = self._token_kl(batch) if self.kl_in_reward else None
        beta = alg.kl_coef if kl is not None else 0.0
        unbiased = alg.std_estimator == "unbiased"
        returns = None
        if alg.mode == "distill":  # the distill term alone (added below); the reward is only reported
            advs = [np.zeros(len(m), np.float32) for m in masks]
        elif self.gae:
            advs, returns = batch_gae(rewards, masks, batch.fields["values"], gamma=alg.gamma, lam=alg.lam, kl=kl,
                                      kl_coef=beta, unbiased=unbiased)
        elif self.name in BATCH_WHITENED:
            advs = batch_whitened(self.name, rewards, masks, batch.groups, kl=kl, kl_coef=beta, gamma=alg.gamma,
                                  unbiased=unbiased)
        else:
            advs, extra["stuck_groups"] = self._per_group(batch, rewards, masks, kl, beta, unbiased)
        if alg.turn_reward_coef > 0:
            advs = [turn_advantages(a, r, m, alg.turn_reward_coef)
                    for a, r, m in zip(advs, batch.fields["turn_rewards"], masks, strict=True)]
        if self.distill:
            advs, extra["distill_reverse_kl"] = self._with_distill(batch, advs, masks)
        values: dict[str, dict[str, Any]] = {sid: {"advantages": a} for sid, a in zip(batch.ids, advs, strict=True)}
        if returns is not None:  # GAE: the critic's regression target
            for sid, r in zip(batch.ids, returns, strict=True):
                values[sid]["returns"] = r
        self.producer.add_fields(values, meta={"step": batch.step})
        return {**kl_metrics(kl, masks), **advantage_stats(advs, masks), **extra}

    def _with_distill(self, batch: Batch, advs: list[np.ndarray], masks: list[np.ndarray]
                      ) -> tuple[list[np.ndarray], float]:
        """Advantages plus the distill term (relax.algorithms.distill), and the batch's sampled reverse KL."""
        f, coef = batch.fields, self.alg.distill_coef
        out, kls = [], []
        for a, lp, tlp, m in zip(advs, f["logprobs"], f["teacher_logprobs"], masks, strict=True):
            behav, teacher, mask = (torch.tensor(x, dtype=torch.float32) for x in (lp, tlp, m))
            out.append((torch.from_numpy(np.asarray(a, np.float32)) + distill_advantages(behav, teacher, mask, coef))
                       .numpy())
            kls.append(float(reverse_kl_estimate(behav, teacher, mask)))
        return out, float(np.mean(kls)) if kls else 0.0

    def _per_group(self, batch: Batch, rewards: list[float], masks: list[np.ndarray], kl: list[np.ndarray] | None,
                   beta: float, unbiased: bool) -> tuple[list[np.ndarray], float]:
        """GRPO / Dr.GRPO / RLOO group by group; also the share of groups that all missed (what
        stuck_group_push acts on, and a collapse's early sign)."""
        by_group: dict[str, list[int]] = {}
        for i, g in enumerate(batch.groups):
            by_group.setdefault(g, []).append(i)
        advs: list[np.ndarray] = [np.zeros(0, np.float32)] * len(rewards)
        stuck = 0
        for idx in by_group.values():
            group = [rewards[i] for i in idx]
            stuck += bool(stuck_groups(torch.tensor(group), len(group)).item())
            out = group_advantages(self.name, group, [masks[i] for i in idx],
                                   kl=None if kl is None else [kl[i] for i in idx], kl_coef=beta,
                                   stuck_push=self.alg.stuck_group_push, unbiased=unbiased)
            for i, a in zip(idx, out, strict=True):
                advs[i] = a
        return advs, stuck / max(len(by_group), 1)

    @property
    def done(self) -> bool:
        return self.stage.done

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch = self.stage.next_batch(timeout)
        extra = self._commit(batch)
        rewards = np.asarray(batch.fields["reward"], dtype=np.float32)
        return {"role": "advantage", "step": batch.step, "samples": len(batch), "reward": float(rewards.mean()),
                **extra, "time_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.stage.close()


def kl_metrics(kl: list[np.ndarray] | None, masks: list[np.ndarray]) -> dict[str, float]:
    """``kl_mean``: mean KL_t over the batch's trained tokens; ``kl_seq``: mean over rows of
    sum_t KL_t (what beta multiplies in a sequence-level estimator's reward)."""
    if kl is None:
        return {}
    tokens = sum(float(np.sum(m)) for m in masks)
    total = [float(np.sum(k)) for k in kl]
    return {"kl_mean": sum(total) / max(tokens, 1.0), "kl_seq": sum(total) / max(len(total), 1)}
