"""The reference role (``algorithm.reference_role=true``): reference logprobs as a column.

The KL anchor is a frozen copy of policy version 0. By default the role that needs it holds
it: the actor for the KL loss term, the advantage role for ``kl_in_reward``. With
``reference_role`` it runs on its own, in its own process (disaggregated) or Serve deployment
(async), as the consumer group ``reference`` of the ``rollouts`` topic: each step takes
``prompts_per_step`` complete groups, scores their tokens (and media) with the reference and
commits ``ref_logprobs`` (float32, one per token, aligned with ``tokens`` like ``logprobs``), or
with ``algorithm.kl_topk`` its top-k at every trained position, ``ref_topk_ids`` (int32) and
``ref_topk_logprobs`` (float32), (R, k) each for the row's last R positions from its first
trained token on (readers pad the prompt's rows back as zeros), plus ``ref_logprobs`` when
``kl_topk_weight`` < 1 keeps part of the KL on the sampled tokens (one forward gives both).
The actor and the advantage role then read that column and hold no second model, which is
the memory and compute a large actor should not spend.

The reference is frozen and the rows are immutable, so the column is a pure function of the
row: a crash between recording a step and committing its column is repaired at start by
computing the recorded step again (as the advantage role does).
"""

from __future__ import annotations

from typing import Any

from relax.services.queue_contract import (
    REFERENCE_FIELDS,
    REFERENCE_GROUP,
    scored_rows,
    topk_reference_fields,
)
from relax.services.roles.column import ColumnStage
from relax.services.roles.media import MediaInputs, to_rollout_batch
from relax.services.run_context import RunContext
from relax.trainers.torch.actor import reference_fields
from relax.transfer.consumer import Batch

ROW_FIELDS = ["tokens", "loss_mask", "prompt_len", "turn_media"]


class ReferenceRole:
    def __init__(self, ctx: RunContext, writer_id: str = "reference", wait_s: float | None = 600.0):
        from relax.services.roles.actor import initial_reference  # the actor publishes version 0 first

        self.reference, processor = initial_reference(ctx, wait_s)
        self.media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
        # the columns the KL reads (``reference_fields``): with kl_topk the top-k at every position, and
        # the sampled tokens' log-probs wherever kl_estimator has a share; one forward gives all three
        alg = ctx.cfg.algorithm
        self.topk = self.reference.topk_width(alg.kl_topk) if alg.kl_topk else 0
        wanted = reference_fields(alg)
        self.fields = tuple(f for f in topk_reference_fields(self.topk) + REFERENCE_FIELDS if f.name in wanted)
        marker = "ref_topk_logprobs" if self.topk else "ref_logprobs"
        self.stage = ColumnStage(ctx, REFERENCE_GROUP, ROW_FIELDS, writer_id, self.fields, marker)
        self.queue, self.consumer, self.producer = self.stage.queue, self.stage.consumer, self.stage.producer
        self.repaired = self.stage.repair(self._commit)

    def _commit(self, batch: Batch) -> None:
        rollout_batch = to_rollout_batch(batch, self.media)
        if self.topk:
            top = self.reference.topk(rollout_batch, self.topk)
            columns = {"ref_topk_ids": top.ids, "ref_topk_logprobs": top.logprobs, "ref_logprobs": top.sampled}
        else:
            columns = {"ref_logprobs": self.reference.logprobs(rollout_batch)}
        rows = scored_rows(batch.ids, batch.fields["loss_mask"], columns, self.fields)
        self.producer.add_fields(rows, meta={"step": batch.step})

    @property
    def done(self) -> bool:
        return self.stage.done

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        return self.stage.scored_step("reference", self._commit, timeout)

    def close(self) -> None:
        self.stage.close()
