"""The ``colocated`` topology: every role in this process, time-sharing its CPUs/GPU.

Whichever role can make progress without waiting does, downstream first (actor, then the
advantage stage, then the reference and reward roles, then the rollout), so a resumed run first
finishes the work already in the queue. With PPO+GAE the critic is stepped beside the advantage
role as one stage.
"""

from __future__ import annotations

from typing import Any

from relax.services.context import RunContext
from relax.services.report.metrics import RoleLogs
from relax.services.roles.factory import advantage_stage, make_role
from relax.services.topologies.progress import Progress
from relax.transfer.errors import QueueTimeout


def run_colocated(ctx: RunContext, progress: bool = True, engine_urls: list[str] | None = None,
                  max_steps: int | None = None) -> None:
    cfg = ctx.cfg
    actor = make_role("actor", ctx)
    # roles of their own (reference, reward), stepped after the advantage stage
    extra: list[Any] = [make_role(role, ctx) for role, on in (("reference", cfg.algorithm.reference_role),
                                                             ("reward", cfg.data.reward_role)) if on]
    adv = advantage_stage(ctx)
    rollout = make_role("rollout", ctx, engine_urls=engine_urls)
    critic = adv.critic if cfg.algorithm.advantage == "gae" else None
    logs = RoleLogs(ctx.run_url)
    bar = Progress(cfg.trainer.total_steps, actor.step_index, progress)
    stop_at = cfg.trainer.total_steps if max_steps is None else min(cfg.trainer.total_steps, max_steps)

    def finished() -> bool:  # the critic also trains on the last batch, so its checkpoint covers the run
        return actor.step_index >= stop_at and (critic is None or critic.trained >= stop_at)

    try:
        while not finished():
            for role in (actor, adv, *extra):
                if role is actor and actor.step_index >= stop_at:
                    continue
                try:
                    m = role.step(timeout=0)
                except QueueTimeout:
                    continue
                logs.append(m)
                if role is actor:
                    bar.actor(m)
                break
            else:
                if actor.step_index >= stop_at:  # only the critic's last update is left: its data is here
                    logs.append(adv.step(timeout=60))
                    continue
                m = rollout.step(timeout=60)
                logs.append(m)
                bar.rollout(m)
    finally:
        bar.close()
        for role in (rollout, adv, *extra, actor):
            role.close()
