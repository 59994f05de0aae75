"""The advantage role: complete prompt groups in, per-token advantages out (a new column).

It is the consumer group ``advantage`` of the ``rollouts`` topic: each step takes
``prompts_per_step`` complete groups, computes the configured estimator per group
(GRPO/Dr.GRPO/RLOO/REINFORCE++; eq. refs in relax.algorithms.advantages) and commits the
``advantages`` field for those samples. A sample whose reward failed (``error`` set) has an
all-zero loss mask, so its advantage is zero everywhere and it trains with zero weight.

With ``advantage=gae`` (PPO with a critic) a group is complete only once the critic role
(relax.services.critic) has committed its ``values``; the step computes GAE over the whole
batch, whitens the advantages over the batch's response tokens (PPO's usual normalisation;
GAE on a sparse outcome reward is otherwise scaled by the reward rate) and commits both
``advantages`` and ``returns`` (A + V before whitening: the critic's regression target).

A crash between recording a step and committing its advantages is repaired at start:
recorded steps whose samples still lack the field are computed again (same inputs, same
output), so no group is ever left without advantages.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from relax.algorithms import compute_advantages, masked_whiten
from relax.services.context import ADVANTAGE_FIELDS, ADVANTAGE_GROUP, RETURN_FIELDS, RunContext
from relax.transfer.consumer import Batch, ConsumerGroup

SEQUENCE_LEVEL = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def _padded(rows: list[np.ndarray]) -> torch.Tensor:
    """B arrays (L_i,) -> (B, max L) float32, zero-padded on the right."""
    out = torch.zeros(len(rows), max(len(r) for r in rows))
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.from_numpy(r.astype(np.float32))
    return out


def group_advantages(name: str, rewards: list[float], masks: list[np.ndarray]) -> list[np.ndarray]:
    """Advantages (L_i,) of one prompt group: ``rewards`` (G,), ``masks`` G arrays (L_i,)."""
    adv, _ = compute_advantages(name, torch.tensor(rewards, dtype=torch.float32), _padded(masks),
                                group_size=len(masks))
    return [adv[i, : len(m)].numpy().astype(np.float32) for i, m in enumerate(masks)]


def batch_gae(rewards: list[float], masks: list[np.ndarray], values: list[np.ndarray], *, gamma: float,
              lam: float) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """GAE of one batch: rewards (B,), masks and values B arrays (L_i,) -> per-sample
    (advantages whitened over the batch's masked tokens, returns), each (L_i,)."""
    mask, v = _padded(masks), _padded(values)
    adv, returns = compute_advantages("gae", torch.tensor(rewards, dtype=torch.float32), mask, values=v,
                                      gamma=gamma, lam=lam)
    adv = masked_whiten(adv, mask)
    return ([adv[i, : len(m)].numpy() for i, m in enumerate(masks)],
            [returns[i, : len(m)].numpy() for i, m in enumerate(masks)])


class AdvantageRole:
    def __init__(self, ctx: RunContext, writer_id: str = "advantage"):
        alg = ctx.cfg.algorithm
        if alg.advantage not in (*SEQUENCE_LEVEL, "gae"):
            raise ValueError(f"algorithm.advantage={alg.advantage!r} is not run by the advantage role; choose one "
                             f"of {(*SEQUENCE_LEVEL, 'gae')}")
        self.ctx, self.name, self.alg = ctx, alg.advantage, alg
        self.gae = alg.advantage == "gae"
        self.queue = ctx.queue()
        needs = ["reward", "loss_mask", "values"] if self.gae else ["reward", "loss_mask"]
        self.consumer = ConsumerGroup(self.queue, ADVANTAGE_GROUP, needs,
                                      batch_groups=ctx.cfg.rollout.prompts_per_step, max_staleness=10**9)
        self.producer = self.queue.producer(writer_id, ADVANTAGE_FIELDS + (RETURN_FIELDS if self.gae else ()),
                                            tokens_field=None)
        self.repaired = self._repair()

    def _repair(self) -> int:
        """Recompute recorded steps whose advantages never got committed (a crash in between)."""
        self.queue.refresh()
        n = 0
        for step in sorted(self.consumer.state.steps):
            ids = self.consumer.state.steps[step]["ids"]
            if any("advantages" not in self.queue.state.samples[sid].locs for sid in ids):
                self._commit(self.consumer.take(step, current_version=0))
                n += 1
        return n

    def _commit(self, batch: Batch) -> None:
        if self.gae:
            advs, returns = batch_gae([float(r) for r in batch.fields["reward"]], batch.fields["loss_mask"],
                                      batch.fields["values"], gamma=self.alg.gamma, lam=self.alg.lam)
            self.producer.add_fields({sid: {"advantages": a, "returns": r}
                                      for sid, a, r in zip(batch.ids, advs, returns, strict=True)},
                                     meta={"step": batch.step})
            return
        by_group: dict[str, list[int]] = {}
        for i, g in enumerate(batch.groups):
            by_group.setdefault(g, []).append(i)
        values: dict[str, dict[str, Any]] = {}
        for idx in by_group.values():
            advs = group_advantages(self.name, [float(batch.fields["reward"][i]) for i in idx],
                                    [batch.fields["loss_mask"][i] for i in idx])
            for i, a in zip(idx, advs, strict=True):
                values[batch.ids[i]] = {"advantages": a}
        self.producer.add_fields(values, meta={"step": batch.step})

    @property
    def done(self) -> bool:
        return self.consumer.next_step >= self.ctx.cfg.trainer.total_steps

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch = self.consumer.take(self.consumer.next_step, current_version=0, timeout=timeout)
        self._commit(batch)
        rewards = np.asarray(batch.fields["reward"], dtype=np.float32)
        return {"role": "advantage", "step": batch.step, "samples": len(batch), "reward": float(rewards.mean()),
                "time_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
