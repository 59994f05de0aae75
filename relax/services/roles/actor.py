"""The actor role: staleness-bounded batches in, policy updates out, weights published.

Step s takes batch s from the consumer group ``actor_train`` at current version s (the
policy version equals the number of updates applied), trains on it, and publishes version
s+1 to the WeightStore. Every ``checkpoint_every`` steps (and at the last step) it saves the
trainer state with the manifest version it consumed up to, and writes a lineage record.

Restart after a crash: the newest complete checkpoint is loaded (step c), and steps c+1..
are taken again. The consumer group hands back exactly the samples it recorded for them,
so nothing is consumed twice and nothing skipped; versions that were already published are
kept (the store is the truth, and on CPU retraining reproduces them bit for bit).
"""

from __future__ import annotations

import time
from typing import Any

from relax import objstore
from relax.config import config_hash
from relax.config.tree import WARM_START_RUN
from relax.faults import fault_point
from relax.services.judge_record import judge_lineage
from relax.services.policy import build_model
from relax.services.queue_contract import ACTOR_GROUP
from relax.services.roles.actor_ranks import actor_ranks, megatron_beside_actor, parallel_model
from relax.services.roles.media import MediaInputs, to_rollout_batch
from relax.services.roles.teacher import teacher_identity
from relax.services.run_context import RunContext
from relax.services.supervision import read_restarts
from relax.trainers.checkpoint.files import read_meta
from relax.trainers.checkpoint.sharded import SHARDED
from relax.trainers.checkpoint.trainer_state import load_newest_good, write_checkpoint
from relax.trainers.torch.actor import AdapterOffReference, Reference, kl_loss_term, reference_fields, teacher_fields
from relax.transfer.adapter_versions import publish_adapter, split
from relax.transfer.consumer import ConsumerGroup, trained_policy_versions
from relax.transfer.lineage import LineageRecord, ParentRef, code_version, record_url, write_record

ACTOR_FIELDS = ["tokens", "loss_mask", "logprobs", "advantages", "prompt_len", "turn_media"]


def actor_reads_reference(cfg: Any) -> bool:
    """The actor's KL loss term takes the reference role's columns (``ref_logprobs``, the
    ``ref_topk_*`` pair with ``kl_topk``, or all three: ``reference_fields``)."""
    a = cfg.algorithm
    return a.reference_role and kl_loss_term(a)


def behaviour_is_proximal(cfg: Any, policy_versions: list[int], version: int) -> bool:
    """Decoupled PPO's proximal policy is the weights before this update. When every row was
    sampled by exactly those weights through an engine whose logprobs equal this trainer's (the
    native engine in float32: tested to 1e-4), the behaviour logprobs the rows carry are the
    proximal ones, and recomputing them is a wasted forward pass over the batch (the main job's
    train step went from 0.30 to 0.24 s without it). SGLang and reduced precision differ from
    the trainer, so there the recomputation is what corrects the mismatch, and it stays."""
    return (cfg.algorithm.off_policy != "none" and cfg.rollout.engine == "native" and cfg.model.dtype == "float32"
            and all(v == version for v in policy_versions))


def run_checkpoint_ref(url: str) -> ParentRef | None:
    """``.../runs/<run>/checkpoints/<name>`` -> that checkpoint as a lineage parent, and
    ``.../warm_start/<key>`` with its lineage record -> that format warm-start; None for anything
    else (a checkpoint from outside Relax's lineage is recorded in the record's ``extra`` only)."""
    parts = url.rstrip("/").split("/")
    if len(parts) >= 4 and parts[-2] == "checkpoints" and parts[-4] == "runs":
        return ParentRef(parts[-3], parts[-1])
    if len(parts) >= 2 and parts[-2] == "warm_start" and objstore.exists(objstore.join(url, "lineage.json")):
        return ParentRef(WARM_START_RUN, parts[-1])
    return None


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(ctx: RunContext) -> list[int]:
    """Steps with a complete checkpoint, oldest first: its meta.json (written after the weights)
    and its lineage record (written after meta.json) both exist.

    A process killed between the two leaves a checkpoint without a record; resuming from it would
    make the next record name a parent that has none and break the chain, so it does not count.
    The rerun resumes one checkpoint earlier, replays the steps after it from the queue's records
    and rewrites that checkpoint, record included."""
    url = objstore.join(ctx.run_url, "checkpoints")
    steps = []
    for name in objstore.list_dir(url):
        if (name.startswith("step-") and objstore.exists(objstore.join(url, name, "meta.json"))
                and objstore.exists(record_url(ctx.root, ctx.cfg.run_id, name))):
            steps.append(int(name[5:]))
    return sorted(steps)


def initial_reference(ctx: RunContext, wait_s: float | None = None) -> tuple[Reference, Any]:
    """The KL anchor and the model's processor: a frozen copy of policy version 0 (the run's
    starting point, warm start included, which the WeightStore always retains), so a
    restarted role gets the same reference. Waits up to ``wait_s`` for the actor to publish it."""
    model, processor = build_model(ctx)
    store = ctx.weights()
    try:
        store.wait_for(0, wait_s)
        state, _ = store.load(0)
    finally:
        store.close()
    model.load_state_dict(split(state)[0])  # a LoRA run's version 0 also holds its starting adapter
    if megatron_beside_actor(ctx.cfg):  # the same weights in megatron-core's layers
        model = parallel_model(model, ctx.cfg, 1)
    return Reference(model, ctx.cfg.trainer.micro_batch_tokens, ctx.cfg.rollout.temperature,
                     ctx.cfg.trainer.micro_batch_layout), processor


class ActorRole:
    def __init__(self, ctx: RunContext):
        cfg = ctx.cfg
        self.ctx, self.cfg = ctx, cfg
        # one process, or rank 0 of trainer.data_parallel x tensor_parallel x pipeline_parallel (actor_ranks)
        self.ranks = actor_ranks(ctx)
        self.actor = self.ranks.ops.actor
        self.media = MediaInputs(ctx.split("train"), ctx.tokenizer, self.ranks.ops.processor, ctx.snapshot.load_media)
        self.store = ctx.weights()
        self.queue = ctx.queue()
        fields = (ACTOR_FIELDS + (reference_fields(cfg.algorithm) if actor_reads_reference(cfg) else [])
                  + (["error"] if cfg.data.reward_role else [])  # zero weight for failed rewards
                  + (["routed_experts"] if cfg.algorithm.routing_replay else [])  # R3: the engine's experts
                  + teacher_fields(cfg.algorithm))  # distill_topk: the teacher role's top-k columns
        self.consumer = ConsumerGroup(self.queue, ACTOR_GROUP, fields,
                                      batch_groups=cfg.rollout.prompts_per_step, max_staleness=cfg.queue.max_staleness)
        self.step_index, self.resumed_from = 0, None
        done = list_checkpoints(ctx)
        found = load_newest_good([self.checkpoint_url(s) for s in done], lambda url: self.ranks.call("resume", url))
        if found is not None:
            self.step_index, self.resumed_from = int(found[1]["step"]) + 1, done[found[0]]
        self.parent_step = self.resumed_from
        if 0 not in self.store.versions():
            meta: dict[str, Any] = {"step": -1}
            if cfg.model.init_checkpoint and self.resumed_from is None:
                self.ranks.call("load_init", cfg.model.init_checkpoint)
                meta["init_checkpoint"] = cfg.model.init_checkpoint
            self.publish(0, meta)
        elif self.resumed_from is None:  # version 0 published before a crash that preceded any checkpoint
            self.ranks.call("load_weights", None, 0)
        # with kl_in_reward the KL is in the advantages (the advantage role holds the reference);
        # with reference_role the rows bring ref_logprobs (relax.services.roles.reference)
        use_ref = kl_loss_term(cfg.algorithm) and not cfg.algorithm.reference_role
        self.reference = None if not use_ref else (
            AdapterOffReference(self.actor.model, cfg.trainer.micro_batch_tokens, cfg.rollout.temperature,
                                cfg.trainer.micro_batch_layout) if cfg.model.lora.rank else initial_reference(ctx)[0])

    def publish(self, version: int, meta: dict[str, Any]) -> None:
        """Publish the policy as ``version``: its whole weights, or with LoRA its adapter (version 0: its
        base too) applying to base version 0 (relax.transfer.adapter_versions)."""
        if not self.cfg.model.lora.rank:
            self.store.publish(version, self.ranks.call("weights"), meta)
            return
        from relax.models.lora import adapter_info

        publish_adapter(self.store, version, self.ranks.call("weights", version == 0), adapter_info(self.cfg.model),
                        meta)

    def lora_record(self) -> dict[str, Any]:
        """A LoRA checkpoint's record of its adapter and the base it applies to (its meta.json and lineage
        record): the base model and base checkpoint, which the checkpoint itself does not hold."""
        if not self.cfg.model.lora.rank:
            return {}
        from relax.models.lora import adapter_info

        return {"lora": {k: v for k, v in adapter_info(self.cfg.model).items() if k != "base_version"}}

    @property
    def version(self) -> int:
        return self.step_index

    @property
    def done(self) -> bool:
        return self.step_index >= self.cfg.trainer.total_steps

    def checkpoint_url(self, step: int) -> str:
        return objstore.join(self.ctx.run_url, "checkpoints", checkpoint_name(step))

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        t0 = time.perf_counter()
        s = self.step_index
        batch = self.consumer.take(s, current_version=self.version, timeout=timeout)
        fault_point("actor", "recorded", s)
        t_data = time.perf_counter()
        rollout_batch = to_rollout_batch(batch, self.media)
        if self.reference is not None and self.cfg.algorithm.kl_topk:
            top = self.reference.topk(rollout_batch, self.cfg.algorithm.kl_topk)
            # the sampled tokens' log-probs come free with the top-k; the loss reads them when kl_topk_weight < 1
            rollout_batch.ref_topk_ids, rollout_batch.ref_topk_logprobs, rollout_batch.ref_logprobs = top
        elif self.reference is not None:
            rollout_batch.ref_logprobs = self.reference.logprobs(rollout_batch)
        if behaviour_is_proximal(self.cfg, batch.policy_versions, self.version):
            rollout_batch.prox_logprobs = rollout_batch.old_logprobs
        result = self.ranks.call("train_step", rollout_batch)
        t_train = time.perf_counter()
        self.step_index += 1
        # a step's record is written before it trains, so only a replayed step can find its
        # version already published (by the incarnation that died): that one is kept
        if not (batch.replayed and self.version in self.store.versions()):
            self.publish(self.version, {"step": s})
        if self.step_index % self.cfg.trainer.checkpoint_every == 0 or self.done:
            self.checkpoint(s)
        staleness = [self.version - 1 - v for v in batch.policy_versions]
        return {"role": "actor", "step": s, "version": self.version, "ranks": self.ranks.world, "loss": result.loss,
                "grad_norm": result.grad_norm, "lr": result.lr, "skipped": result.skipped,
                "samples": len(batch), "tokens": result.tokens, "replayed": batch.replayed,
                "staleness_max": max(staleness), "staleness_mean": sum(staleness) / len(staleness),
                "wait_s": t_data - t0, "train_s": t_train - t_data, "time_s": time.perf_counter() - t0,
                **{k: float(v) for k, v in result.metrics.items()}}

    def checkpoint(self, step: int) -> str:
        cfg = self.cfg
        manifest = self.queue.compact(writer_id="actor-compactor")
        meta = {"steps_done": self.actor.trainer.steps_done, "step": step, "version": self.version,
                "manifest_version": manifest, **self.lora_record()}
        url = objstore.absolute_url(self.checkpoint_url(step))
        if cfg.trainer.checkpoint_format == SHARDED:  # each rank writes its part, rank 0 the rest
            self.ranks.call("save_sharded", url, meta)
        else:
            write_checkpoint(url, self.ranks.call("checkpoint_state"), meta)
        parent = (ParentRef(cfg.run_id, checkpoint_name(self.parent_step)) if self.parent_step is not None
                  else run_checkpoint_ref(cfg.model.init_checkpoint))
        counts = trained_policy_versions(self.queue, ACTOR_GROUP, up_to_step=step,
                                         after_step=-1 if self.parent_step is None else self.parent_step)
        write_record(self.ctx.root, LineageRecord(
            cfg.run_id, checkpoint_name(step), step, parent, self.ctx.snapshot_info.id, config_hash(cfg),
            code_version(), {"rollouts": manifest}, counts, time.time(),
            {"weight_version": self.version, "checkpoint_url": url,
             "restarts": read_restarts(self.ctx.run_url),  # roles healed so far (relax.services.supervision)
             **({"init_checkpoint": cfg.model.init_checkpoint} if cfg.model.init_checkpoint else {}),
             **({"teacher": teacher_identity(cfg)} if cfg.algorithm.distill_coef > 0 else {}),
             **(judge_lineage(self.ctx.run_url) if cfg.genrm.enabled else {}),  # the judge that graded it
             **self.lora_record()}), redo=True)
        self.parent_step = step
        kept = list_checkpoints(self.ctx)[-cfg.queue.keep_checkpoints:]
        # the rollout may still need version (actor's - max_staleness) for its next batch (queue.exact_staleness)
        self.store.retain([read_meta(self.checkpoint_url(k))["version"] for k in kept] + [0],
                          keep_latest=max(2, cfg.queue.max_staleness + 1))
        return url

    def close(self) -> None:
        self.consumer.close()
        self.store.close()
        self.ranks.close()
