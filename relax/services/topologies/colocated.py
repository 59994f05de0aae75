"""The ``colocated`` topology: every role in this process, time-sharing its CPUs/GPU.

Whichever role can make progress without waiting does, downstream first (actor, then the
advantage stage, then the reference, reward and teacher roles, then the rollout), so a resumed run first
finishes the work already in the queue. With PPO+GAE the critic is stepped beside the advantage
role as one stage. A step that makes no progress for ``supervisor.hang_timeout_s`` ends the
process (relax.services.heartbeat.SelfWatch): nothing outside it could restart one role.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

from relax import liveness
from relax.faults import set_attempt
from relax.services.heartbeat import SelfWatch
from relax.services.report.metrics import RoleLogs
from relax.services.roles.factory import advantage_stage, make_role
from relax.services.run_context import RunContext
from relax.services.supervision import NOT_HEALED, RoleFailure, Supervisor
from relax.services.topologies.progress import Progress
from relax.transfer.errors import QueueTimeout


class RoleStepFailed(Exception):
    """A role's step raised (not at construction: a role that cannot be built is a config problem)."""

    def __init__(self, role: str, traceback_text: str):
        super().__init__(role)
        self.role, self.traceback_text = role, traceback_text


def run_colocated(ctx: RunContext, progress: bool = True, engine_urls: list[str] | None = None,
                  max_steps: int | None = None) -> None:
    """Run the roles until the run's last step; a role whose step fails is healed by building every
    role again (they resume from the queue and the checkpoint, as a rerun does) after a backoff."""
    sup = ctx.cfg.supervisor
    supervisor = Supervisor(ctx.run_url, sup)
    watch = SelfWatch(sup.hang_timeout_s, check_s=sup.heartbeat_s)  # a stuck step ends the process
    attempt = 0
    try:
        while True:
            set_attempt(attempt)
            try:
                _run_roles(ctx, progress, engine_urls, max_steps)
                return
            except RoleStepFailed as e:
                failure = RoleFailure(e.role, attempt, "exception", e.traceback_text, "(this process's output)")
                time.sleep(supervisor.failed(failure))  # raises RunStopped past supervisor.max_restarts
                attempt += 1
    finally:
        watch.stop()


def _step(name: str, role: Any, timeout: float) -> dict[str, Any]:
    try:
        out = role.step(timeout=timeout)
    except QueueTimeout:
        liveness.mark(liveness.WAITING)  # nothing for this role yet: the loop moves on, which is progress
        raise
    except NOT_HEALED:
        raise
    except Exception as e:
        raise RoleStepFailed(name, traceback.format_exc()) from e
    liveness.mark(liveness.WORKING)
    return out


def _run_roles(ctx: RunContext, progress: bool, engine_urls: list[str] | None, max_steps: int | None) -> None:
    cfg = ctx.cfg
    actor = make_role("actor", ctx)
    # roles of their own (reference, reward, teacher), stepped after the advantage stage
    own = [role for role, on in (("reference", cfg.algorithm.reference_role), ("reward", cfg.data.reward_role),
                                 ("teacher", cfg.algorithm.distill_coef > 0)) if on]
    extra: list[Any] = [make_role(role, ctx) for role in own]
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
            for name, role in (("actor", actor), ("advantage", adv), *zip(own, extra, strict=True)):
                if role is actor and actor.step_index >= stop_at:
                    continue
                try:
                    m = _step(name, role, timeout=0)
                except QueueTimeout:
                    continue
                logs.append(m)
                if role is actor:
                    bar.actor(m)
                break
            else:
                if actor.step_index >= stop_at:  # only the critic's last update is left: its data is here
                    logs.append(_step("advantage", adv, timeout=60))
                    continue
                m = _step("rollout", rollout, timeout=60)
                logs.append(m)
                bar.rollout(m)
    finally:
        bar.close()
        for role in (rollout, adv, *extra, actor):
            role.close()
