"""The advantage role: complete prompt groups in, per-token advantages out (a new column).

It is the consumer group ``advantage`` of the ``rollouts`` topic: each step takes
``prompts_per_step`` complete groups, computes the configured estimator per group
(GRPO/Dr.GRPO/RLOO/REINFORCE++; eq. refs in relax.algorithms.advantages) and commits the
``advantages`` field for those samples. A sample whose reward failed (``error`` set) has an
all-zero loss mask, so its advantage is zero everywhere and it trains with zero weight.

A crash between recording a step and committing its advantages is repaired at start:
recorded steps whose samples still lack the field are computed again (same inputs, same
output), so no group is ever left without advantages.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from relax.algorithms import compute_advantages
from relax.services.context import ADVANTAGE_FIELDS, ADVANTAGE_GROUP, RunContext
from relax.transfer.consumer import Batch, ConsumerGroup

SEQUENCE_LEVEL = ("grpo", "drgrpo", "rloo", "reinforce_pp", "reinforce_pp_baseline")


def group_advantages(name: str, rewards: list[float], masks: list[np.ndarray]) -> list[np.ndarray]:
    """Advantages (L_i,) of one prompt group: ``rewards`` (G,), ``masks`` G arrays (L_i,)."""
    longest = max(len(m) for m in masks)
    mask = torch.zeros(len(masks), longest)
    for i, m in enumerate(masks):
        mask[i, : len(m)] = torch.from_numpy(m.astype(np.float32))
    adv, _ = compute_advantages(name, torch.tensor(rewards, dtype=torch.float32), mask, group_size=len(masks))
    return [adv[i, : len(m)].numpy().astype(np.float32) for i, m in enumerate(masks)]


class AdvantageRole:
    def __init__(self, ctx: RunContext, writer_id: str = "advantage"):
        alg = ctx.cfg.algorithm
        if alg.advantage not in SEQUENCE_LEVEL:
            raise ValueError(f"algorithm.advantage={alg.advantage!r} needs values from a critic role, which this "
                             f"runtime does not run yet; choose one of {SEQUENCE_LEVEL}")
        self.ctx, self.name = ctx, alg.advantage
        self.queue = ctx.queue()
        self.consumer = ConsumerGroup(self.queue, ADVANTAGE_GROUP, ["reward", "loss_mask"],
                                      batch_groups=ctx.cfg.rollout.prompts_per_step, max_staleness=10**9)
        self.producer = self.queue.producer(writer_id, ADVANTAGE_FIELDS, tokens_field=None)
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
