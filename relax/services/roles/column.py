"""The shared plumbing of a role that adds a column to rollout rows (advantage, reward, reference).

Such a role is a consumer group of the ``rollouts`` topic taking ``prompts_per_step``
complete prompt groups per step, with no staleness bound (it only annotates rows; the actor
bounds staleness), and a producer that commits its fields for exactly those rows. Its output
is a pure function of the rows, so a restart repairs a step recorded before a crash but never
committed by computing it again (:meth:`ColumnStage.repair`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from relax.faults import fault_point
from relax.services.run_context import RunContext
from relax.transfer.columns import Field
from relax.transfer.consumer import Batch, ConsumerGroup


class ColumnStage:
    """``group`` reads ``needs`` and writes ``fields`` as ``writer_id``; ``marker`` is the field
    whose absence marks a row as not yet done."""

    def __init__(self, ctx: RunContext, group: str, needs: Sequence[str], writer_id: str,
                 fields: Sequence[Field], marker: str):
        self.queue = ctx.queue()
        self.consumer = ConsumerGroup(self.queue, group, list(needs), batch_groups=ctx.cfg.rollout.prompts_per_step,
                                      max_staleness=10**9)
        self.producer = self.queue.producer(writer_id, tuple(fields), tokens_field=None)
        self.marker, self.total, self.group = marker, ctx.cfg.trainer.total_steps, group

    def repair(self, commit: Callable[[Batch], Any]) -> int:
        """Commit again the recorded steps whose column never got committed; returns how many."""
        missing = self.consumer.steps_missing(self.marker)
        for step in missing:
            commit(self.consumer.take(step, current_version=0))
        return len(missing)

    @property
    def done(self) -> bool:
        return self.consumer.next_step >= self.total

    def next_batch(self, timeout: float | None) -> Batch:
        batch = self.consumer.take(self.consumer.next_step, current_version=0, timeout=timeout)
        fault_point(self.group, "recorded", batch.step)  # the crash repair() exists for
        return batch

    def scored_step(self, role: str, commit: Callable[[Batch], Any], timeout: float | None) -> dict[str, Any]:
        """One step of a role that scores the rows' tokens (reference, teacher): take the next batch,
        ``commit`` its column, and report the step's size and time."""
        t0 = time.perf_counter()
        batch = self.next_batch(timeout)
        commit(batch)
        return {"role": role, "step": batch.step, "samples": len(batch),
                "tokens": int(sum(len(t) for t in batch.fields["tokens"])), "time_s": time.perf_counter() - t0}

    def close(self) -> None:
        self.consumer.close()
        self.producer.close()
