"""The critic role (PPO with GAE): values for rollout rows out, a value head trained on returns.

It is two consumer groups of the ``rollouts`` topic, used in strict alternation:

* ``critic_values`` step s takes ``prompts_per_step`` complete groups and commits the field
  ``values`` (per token, aligned with ``tokens``: V of the state before each token) that the
  advantage role waits for to compute GAE;
* ``critic_train`` step s takes groups whose ``returns`` the advantage role has committed and
  makes one clipped-value-loss update on them.

Values of step s are always read after exactly s updates, so a run's values do not depend on
how the roles were scheduled, and a restart reproduces them: the critic reloads its newest
checkpoint (``<run>/critic/checkpoints/step-N/``, trained through step N), re-takes steps
N+1.. from the groups' records (the same samples), skips re-committing values that are
already in the queue, and continues. A fresh critic starts from policy version 0 (the run's
starting point, warm start included) with a zero value head. With ``trainer.backend=megatron``
the value model is megatron-core's (``relax.trainers.megatron.value``), same state-dict layout.

Disaggregated and async, the critic is its own process / Serve deployment (``relax role
critic``) running :class:`CriticRole` alone. :class:`CriticAndAdvantage` is the colocated
topology's GAE stage: the critic and the advantage role stepping whichever can move.
"""

from __future__ import annotations

import time
import warnings
from typing import Any

import torch

from relax import objstore
from relax.faults import fault_point
from relax.models.value_head import ValueHeadModel
from relax.services.policy import build_model
from relax.services.queue_contract import CRITIC_TRAIN_GROUP, CRITIC_VALUES_GROUP, VALUE_FIELDS
from relax.services.roles.actor_ranks import megatron_beside_actor
from relax.services.roles.advantage import AdvantageRole
from relax.services.roles.media import MediaInputs, to_rollout_batch
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.trainer_state import load_checkpoint, load_newest_good
from relax.trainers.torch.critic import Critic
from relax.transfer.consumer import ConsumerGroup
from relax.transfer.errors import QueueTimeout

ROW_FIELDS = ["tokens", "loss_mask", "prompt_len", "turn_media"]


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def critic_checkpoints(run_url: str) -> list[int]:
    """Steps with a complete critic checkpoint (meta.json is written last), oldest first."""
    url = objstore.join(run_url, "critic", "checkpoints")
    return sorted(int(n[5:]) for n in objstore.list_dir(url)
                  if n.startswith("step-") and objstore.exists(objstore.join(url, n, "meta.json")))


class CriticRole:
    def __init__(self, ctx: RunContext, wait_s: float | None = 600.0):
        cfg = ctx.cfg
        self.ctx, self.cfg = ctx, cfg
        policy, processor = build_model(ctx)
        if megatron_beside_actor(cfg):  # same weights in megatron-core's layers (relax.trainers.megatron.value)
            with warnings.catch_warnings():  # megatron announces every fused kernel it falls back from
                warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
                from relax.trainers.megatron.value import megatron_value_model

                model: torch.nn.Module = megatron_value_model(policy, seed=cfg.seed)
        else:
            model = ValueHeadModel(policy)
        self.critic = Critic.for_run(model, cfg, pad_id=ctx.tokenizer.pad_token_id or 0)
        self.media = MediaInputs(ctx.split("train"), ctx.tokenizer, processor, ctx.snapshot.load_media)
        self.queue = ctx.queue()
        groups = cfg.rollout.prompts_per_step
        # the critic never drops a sample for staleness: every sample needs values for its advantages
        self.values_group = ConsumerGroup(self.queue, CRITIC_VALUES_GROUP, ROW_FIELDS, batch_groups=groups,
                                          max_staleness=10**9)
        self.train_group = ConsumerGroup(self.queue, CRITIC_TRAIN_GROUP, [*ROW_FIELDS, "values", "returns"],
                                         batch_groups=groups, max_staleness=10**9)
        self.producer = self.queue.producer("critic", VALUE_FIELDS, tokens_field=None)
        self.trained, self.resumed_from = 0, None
        done = critic_checkpoints(ctx.run_url)
        # the RNG stays as it is: the critic draws no random numbers, and in a colocated run
        # the actor has just restored its own
        found = load_newest_good([self.checkpoint_url(s) for s in done], lambda url: load_checkpoint(
            url, self.critic.model, self.critic.trainer.optimizer, self.critic.trainer.scheduler, restore_rng=False))
        if found is not None:
            meta = found[1]
            self.critic.trainer.steps_done = int(meta["steps_done"])
            self.trained, self.resumed_from = int(meta["step"]) + 1, done[found[0]]
        else:
            store = ctx.weights()
            store.wait_for(0, wait_s)  # the actor publishes version 0 (after any warm start)
            state, _ = store.load(0)
            self.critic.model.backbone.load_state_dict(state)
        self.valued = self.trained  # values of step s come from the critic after s updates

    @property
    def done(self) -> bool:
        return self.trained >= self.cfg.trainer.total_steps

    def checkpoint_url(self, step: int) -> str:
        return objstore.join(self.ctx.run_url, "critic", "checkpoints", checkpoint_name(step))

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        """The next values step, or the training step that must follow it; raises QueueTimeout
        when its data is not there within ``timeout``."""
        return self._values(timeout) if self.valued == self.trained else self._train(timeout)

    def _values(self, timeout: float | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        s = self.valued
        batch = self.values_group.take(s, current_version=0, timeout=timeout)
        fault_point("critic", "recorded", s)
        committed = batch.replayed and all("values" in self.queue.state.samples[sid].locs for sid in batch.ids)
        value_mean = float("nan")
        if not committed:  # a replayed step whose values were committed before the restart keeps them
            rows = to_rollout_batch(batch, self.media)
            values = self.critic.values(rows)
            self.producer.add_fields({sid: {"values": v.numpy()} for sid, v in zip(batch.ids, values, strict=True)},
                                     meta={"step": s})
            masked = [(v * m).sum() / m.sum().clamp(min=1) for v, m in zip(values, rows.loss_mask, strict=True)]
            value_mean = float(torch.stack(masked).mean())
        self.valued += 1
        return {"role": "critic", "kind": "values", "step": s, "samples": len(batch), "replayed": batch.replayed,
                "reused": committed, "value_mean": value_mean, "time_s": time.perf_counter() - t0}

    def _train(self, timeout: float | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        s = self.trained
        batch = self.train_group.take(s, current_version=0, timeout=timeout)
        result = self.critic.train_step(to_rollout_batch(batch, self.media))
        self.trained += 1
        if self.trained % self.cfg.trainer.checkpoint_every == 0 or self.done:
            self.critic.trainer.save(self.checkpoint_url(s), {"step": s})
        return {"role": "critic", "kind": "train", "step": s, "loss": result.loss, "grad_norm": result.grad_norm,
                "lr": result.lr, "skipped": result.skipped, "samples": len(batch), "replayed": batch.replayed,
                "time_s": time.perf_counter() - t0, **{k: float(v) for k, v in result.metrics.items()}}

    def close(self) -> None:
        self.values_group.close()
        self.train_group.close()
        self.producer.close()


class CriticAndAdvantage:
    """The GAE advantage stage of one process: critic and advantage role, whichever can move.

    ``step`` returns the metrics of the one step it made (``role`` says whose); with nothing
    to do for ``timeout`` seconds it raises QueueTimeout, like a single role.
    """

    def __init__(self, ctx: RunContext, wait_s: float | None = 600.0):
        self.critic = CriticRole(ctx, wait_s)
        self.advantage = AdvantageRole(ctx)

    @property
    def done(self) -> bool:
        return self.critic.done and self.advantage.done

    def step(self, timeout: float | None = None) -> dict[str, Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            # the critic first: its training step is what the next values (and so GAE) wait on
            for role in (self.critic, self.advantage):
                if role.done:  # a done critic waits on nothing; a done advantage role takes no extra batch
                    continue
                try:
                    return role.step(timeout=0)
                except QueueTimeout:
                    pass
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise QueueTimeout(f"critic (values step {self.critic.valued}, train step {self.critic.trained}) and "
                                   f"advantage (step {self.advantage.consumer.next_step}): no data within {timeout} s")
            self.critic.queue.wait_for_new(min(left, 1.0) if left is not None else 1.0)

    def close(self) -> None:
        self.advantage.close()
        self.critic.close()
