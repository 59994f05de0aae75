"""The teacher role (on-policy distillation): the teacher's log-probability of every sampled token, as a column.

With ``algorithm.distill_coef`` > 0 the run has a teacher (the ``teacher`` config section: a
built-in or local model of the student's family and tokenizer, with ``teacher.checkpoint``'s
weights). This role is the consumer group ``teacher`` of the ``rollouts`` topic: each step takes
``prompts_per_step`` complete groups, scores their tokens (and media) with the frozen teacher and
commits ``teacher_logprobs`` (float32, one per token, aligned with ``tokens`` like ``logprobs``,
at the rollout's temperature). The advantage role reads it (relax.algorithms.distill). With
``algorithm.distill_topk`` = k the same forward also gives the teacher's k likeliest tokens and
their log-probs at every trained position, ``teacher_topk_ids`` / ``teacher_topk_logprobs`` ((R, k)
each, as the reference's top-k columns), for the actor's exact top-k KL to the teacher.

It runs as every other column role does: in the colocated loop, as its own process
(disaggregated) or Serve deployment (async); the teacher is frozen and the rows immutable, so the
column is a pure function of the row and a step recorded before a crash is computed again at
start (``ColumnStage.repair``): a killed teacher leaves no step without its column and none twice.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from relax.config import ModelConfig, RelaxConfig
from relax.services.queue_contract import TEACHER_FIELDS, TEACHER_GROUP, scored_rows, topk_reference_fields
from relax.services.roles.column import ColumnStage
from relax.services.roles.media import MediaInputs, to_rollout_batch
from relax.services.roles.teacher_remote import RemoteTeacher
from relax.services.run_context import RunContext
from relax.trainers.torch.actor import Reference
from relax.transfer.consumer import Batch

ROW_FIELDS = ["tokens", "loss_mask", "prompt_len", "turn_media"]


def teacher_model_config(cfg: RelaxConfig) -> ModelConfig:
    """The teacher as a ModelConfig: the student's family, dtype and context, the teacher section's model."""
    t = cfg.teacher
    return dataclasses.replace(cfg.model, name_or_path=t.name_or_path, tokenizer=t.tokenizer or cfg.model.tokenizer,
                               hidden_size=t.hidden_size, num_layers=t.num_layers, num_heads=t.num_heads,
                               init_checkpoint="", value_head=False)


def teacher_identity(cfg: RelaxConfig) -> dict[str, Any]:
    """What names the teacher in lineage records: its model, sizes and checkpoint."""
    t = cfg.teacher
    if t.url:  # the server holds the weights; its URL is what names it here
        return {"url": t.url, "family": cfg.model.family, "tokenizer": t.tokenizer or cfg.model.tokenizer}
    return {"name_or_path": t.name_or_path, "family": cfg.model.family, "checkpoint": t.checkpoint,
            "hidden_size": t.hidden_size, "num_layers": t.num_layers, "num_heads": t.num_heads,
            "tokenizer": t.tokenizer or cfg.model.tokenizer}


def build_teacher(ctx: RunContext) -> tuple[Reference, Any]:
    """The frozen teacher (a Reference scorer) and its processor."""
    from relax.models import build_policy
    from relax.trainers.checkpoint.trainer_state import load_checkpoint

    cfg = ctx.cfg
    model, processor = build_policy(teacher_model_config(cfg), ctx.tokenizer, seed=cfg.seed)
    if cfg.teacher.checkpoint:
        load_checkpoint(cfg.teacher.checkpoint, model, restore_rng=False)  # a shape mismatch names the tensor
    model.eval().requires_grad_(False)
    return Reference(model, cfg.trainer.micro_batch_tokens, cfg.rollout.temperature,
                     cfg.trainer.micro_batch_layout), processor


class LocalTeacher:
    """The teacher built in this process (teacher.name_or_path): its columns from one forward per micro-batch."""

    def __init__(self, ctx: RunContext, k: int):
        self.teacher, processor = build_teacher(ctx)
        self.media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
        self.topk = self.teacher.topk_width(k) if k else 0

    def columns(self, batch: Batch) -> dict[str, list[Any]]:
        rollout_batch = to_rollout_batch(batch, self.media)
        if self.topk:  # one forward: the sampled tokens' log-probs and the top-k
            top = self.teacher.topk(rollout_batch, self.topk)
            return {"teacher_logprobs": top.sampled, "teacher_topk_ids": top.ids, "teacher_topk_logprobs": top.logprobs}
        return {"teacher_logprobs": self.teacher.logprobs(rollout_batch)}


class TeacherRole:
    def __init__(self, ctx: RunContext, writer_id: str = "teacher"):
        k = ctx.cfg.algorithm.distill_topk
        url = ctx.cfg.teacher.url
        self.scorer = RemoteTeacher(url, k) if url else LocalTeacher(ctx, k)  # both: .topk, .columns(batch)
        self.topk = self.scorer.topk
        self.fields = TEACHER_FIELDS + (topk_reference_fields(self.topk, "teacher") if self.topk else ())
        self.stage = ColumnStage(ctx, TEACHER_GROUP, ROW_FIELDS, writer_id, self.fields, "teacher_logprobs")
        self.queue, self.consumer, self.producer = self.stage.queue, self.stage.consumer, self.stage.producer
        self.repaired = self.stage.repair(self._commit)

    def _commit(self, batch: Batch) -> None:
        rows = scored_rows(batch.ids, batch.fields["loss_mask"], self.scorer.columns(batch), self.fields)
        self.producer.add_fields(rows, meta={"step": batch.step})

    @property
    def done(self) -> bool:
        return self.stage.done

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        return self.stage.scored_step("teacher", self._commit, timeout)

    def close(self) -> None:
        self.stage.close()
