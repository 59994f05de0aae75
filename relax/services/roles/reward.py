"""The reward role (``data.reward_role=true``): rewards as a column, scored off the rollout.

By default the rollout scores each response as it finishes (verifier, ``data.reward_fn`` or
the judge, relax.rollout.rewards). With ``reward_role`` it commits rows without ``reward``
and ``error``, and this role, in its own process (disaggregated) or Serve deployment (async),
is the consumer group ``reward``: each step takes ``prompts_per_step`` complete groups, scores
every row's ``response`` against its sample (found by the row id in the snapshot) and commits
``reward`` and ``error``. Slow verifiers and judge round-trips then leave generation alone.

A reward that fails is reward 0 with its error text, as in the rollout; a row with an error
trains with zero weight because its consumers zero its loss mask (``media.effective_masks``).
Rewards are a pure function of the row, so a crash between recording a step and committing
it is repaired at start by scoring the recorded step again.

With ``genrm`` (a generative reward model) the scorer is the judge of
relax.services.judge_engines: the whole batch goes to its engines in one batched call, each
commit carries the judge's identity in its meta, and the step's metrics count its verdicts.

Not with ``rollout.dynamic_sampling`` (the rollout filters groups by reward) nor with agent
episodes (their reward comes from the env, during the rollout).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from relax.data.samples import Sample
from relax.rollout.rewards import RewardDispatcher, reward_metrics
from relax.services.judge_engines import open_judge
from relax.services.queue_contract import REWARD_FIELDS, REWARD_GROUP
from relax.services.roles.column import ColumnStage
from relax.services.roles.media import sample_id_of
from relax.services.run_context import RunContext
from relax.transfer.consumer import Batch

ROW_FIELDS = ["response"]


class RewardRole:
    def __init__(self, ctx: RunContext, writer_id: str = "reward"):
        self.samples = {s.id: s for s in ctx.split("train")}
        # a generative judge (genrm) or the verifiers / data.reward_fn / data.judge_url
        self.judge = open_judge(ctx) if ctx.cfg.genrm.enabled else None
        self.rewards = self.judge or RewardDispatcher.for_training(ctx.cfg)
        self.meta = {"judge": self.judge.identity} if self.judge is not None else {}
        self.stage = ColumnStage(ctx, REWARD_GROUP, ROW_FIELDS, writer_id, REWARD_FIELDS, "reward")
        self.queue, self.consumer, self.producer = self.stage.queue, self.stage.consumer, self.stage.producer
        self.repaired = self.stage.repair(self._commit)

    def _commit(self, batch: Batch) -> list[tuple[Sample, float, str]]:
        pairs = [(str(r), self.samples[sample_id_of(sid)]) for sid, r in zip(batch.ids, batch.fields["response"],
                                                                              strict=True)]
        scored = self.rewards.score_many(pairs, batch.ids)
        self.producer.add_fields({sid: {"reward": np.float32(s.reward), "error": s.error}
                                  for sid, s in zip(batch.ids, scored, strict=True)},
                                 meta={"step": batch.step, **self.meta})
        return [(sample, s.reward, s.error) for (_, sample), s in zip(pairs, scored, strict=True)]

    @property
    def done(self) -> bool:
        return self.stage.done

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        batch = self.stage.next_batch(timeout)
        scored = self._commit(batch)
        metrics: dict[str, Any] = {"role": "reward", "step": batch.step, "samples": len(batch),
                                   "reward": float(np.mean([r for _, r, _ in scored])),
                                   "reward_errors": sum(bool(e) for _, _, e in scored),
                                   "time_s": time.perf_counter() - t0}
        metrics.update(reward_metrics([(sample, r) for sample, r, _ in scored]))
        if self.judge is not None:
            metrics.update(self.judge.metrics())
        return metrics

    def close(self) -> None:
        try:
            self.stage.close()
        finally:
            if self.judge is not None:
                self.judge.close()
