"""The one place roles are named, built and sized: every topology goes through it.

A role is an object with ``step(timeout)`` (one unit of work, returning its metrics record),
``close()`` and a way to tell that it has finished the run (:func:`role_done`). Which roles a
run has depends on its config: the critic only with PPO+GAE, the reference and the reward
roles only when the config gives them a role of their own, the teacher with on-policy distillation.
"""

from __future__ import annotations

from typing import Any, Protocol

from relax.config import RelaxConfig
from relax.services.report.metrics import ROLES
from relax.services.roles.actor import ActorRole
from relax.services.roles.advantage import AdvantageRole
from relax.services.roles.critic import CriticAndAdvantage, CriticRole
from relax.services.roles.reference import ReferenceRole
from relax.services.roles.reward import RewardRole
from relax.services.roles.rollout import RolloutRole
from relax.services.roles.teacher import TeacherRole
from relax.services.run_context import RunContext

ROLE_NAMES = ROLES  # every role a run can have
COLUMN_ROLES = ("advantage", "reference", "critic", "reward", "teacher")


class Role(Protocol):
    """What a topology needs of a role."""

    def step(self, timeout: float | None = None) -> dict[str, Any]: ...

    def close(self) -> None: ...


def role_names(cfg: RelaxConfig) -> tuple[str, ...]:
    """The roles a run starts as processes (disaggregated) or deployments (async), in start
    order: the actor publishes version 0 that the others wait for."""
    return (("actor", "advantage", "rollout") + (("critic",) if cfg.algorithm.advantage == "gae" else ())
            + (("reference",) if cfg.algorithm.reference_role else ())
            + (("reward",) if cfg.data.reward_role else ())
            + (("teacher",) if cfg.algorithm.distill_coef > 0 else ()))


#: The Ray cluster each role runs on in a cluster deployment of the disaggregated topology: the
#: rollout group beside the engines (rollout_gpus) with the roles that score what they generate,
#: the learner group beside the actor (actor_gpus) with the roles that feed its batches.
ROLE_GROUPS: dict[str, str] = {"rollout": "rollout", "reward": "rollout", "teacher": "rollout",
                               "actor": "learner", "advantage": "learner", "reference": "learner",
                               "critic": "learner"}


def group_roles(cfg: RelaxConfig, group: str) -> tuple[str, ...]:
    """The roles of ``role_names(cfg)`` that run in ``group`` (``rollout`` or ``learner``)."""
    if group not in set(ROLE_GROUPS.values()):
        raise ValueError(f"unknown role group {group!r}; groups are rollout, learner")
    return tuple(r for r in role_names(cfg) if ROLE_GROUPS[r] == group)


def make_role(role: str, ctx: RunContext, *, engine_urls: list[str] | None = None, wait_s: float | None = 600.0,
              api_mode: str = "thread") -> Role:
    """Build role ``role`` of ``ctx``'s run. ``wait_s`` bounds how long a role that needs another's first
    output (the reference and critic wait for version 0) waits at start; ``api_mode`` goes to the rollout."""
    if role == "rollout":
        return RolloutRole(ctx, engine_urls, api_mode=api_mode)
    if role == "actor":
        return ActorRole(ctx)
    if role == "advantage":  # with PPO+GAE it waits for the critic role's values column
        return AdvantageRole(ctx)
    if role == "reference":
        return ReferenceRole(ctx, wait_s=wait_s)
    if role == "critic":
        return CriticRole(ctx, wait_s=wait_s)
    if role == "reward":
        return RewardRole(ctx)
    if role == "teacher":
        return TeacherRole(ctx)
    raise ValueError(f"unknown role {role!r}; roles are {', '.join(ROLE_NAMES)}")


def advantage_stage(ctx: RunContext, wait_s: float | None = 600.0) -> Role:
    """The colocated stage that puts advantages on the rows: the advantage role alone, or with
    PPO+GAE the critic beside it, stepped as one."""
    if ctx.cfg.algorithm.advantage == "gae":
        return CriticAndAdvantage(ctx, wait_s)
    return AdvantageRole(ctx)


def role_done(role: str, obj: Any, total: int) -> bool:
    """Whether ``obj`` (role ``role``) has done its part of a run of ``total`` steps."""
    if role == "actor":
        return obj.step_index >= total
    if role in COLUMN_ROLES:
        return obj.done
    return obj.batch >= total


def role_threads(role: str, cfg: RelaxConfig) -> int:
    """Torch threads of a role in a process of its own: rollout and actor each get half the CPUs,
    so they overlap instead of contending. Retraining a step bit for bit needs the same count
    (``relax replay --retrain``): a float32 reduction split over other threads sums in another order."""
    return 1 if role in COLUMN_ROLES else max(1, cfg.resources.num_cpus // 2)
