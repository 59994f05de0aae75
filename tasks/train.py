"""The RL train step as Flyte Ray tasks, sized from ``RelaxConfig.resources``.

A task decorator is evaluated once, at import, so the Ray cluster a *registered* task asks for
is fixed when it is registered: ``ray_job_config(cluster_resources())``, i.e. the defaults, or the
``resources`` section of the preset or config file named by ``RELAX_CLUSTER_CONFIG``::

    RELAX_CLUSTER_CONFIG=qwen2.5-omni-3b pyflyte register --image ... workflows/

The workflow calls ``train`` (a dynamic task) instead, which reads the run's config at run time and
re-sizes the Ray tasks it launches to that config's ``resources``; so a cluster preset passed as
``--cfg`` gets its own cluster shape without re-registering. (``with_overrides(task_config=...)``
would do the same, but it mutates the shared task object: a fresh task per run is safer.)

Topologies: ``colocated`` and ``async`` are one Ray task (``train_step``). ``disaggregated`` is
one Ray task per role group (``rollout_group``, ``learner_group``; which role runs where is
``relax.services.roles.factory.ROLE_GROUPS``, over the roles ``role_names(cfg)`` starts) that a
Flyte cluster runs concurrently; they meet only in the run root. Each group's pod runs the same
controller as a local disaggregated run (restarts, backoff, hang detection, ``relax status``),
with its roles placed by Ray (relax.services.launchers.ray_role). Local Flyte runs execute nodes
one after another, which would leave the rollout group waiting for a learner that never starts,
so a local disaggregated run goes through ``train_step`` and relax starts the roles as OS
processes. ``python infra/cluster_run.py`` executes the cluster path (docs/workflows.md).

Retries are safe everywhere: every task resumes the run under its root from its last checkpoint
(same run id, same config), so a retried pod neither repeats nor skips samples.
"""

from __future__ import annotations

import math
import os
from dataclasses import replace
from datetime import timedelta

from flytekit import Resources, dynamic, task
from flytekit.core.context_manager import FlyteContextManager
from flytekit.core.task import TaskPlugins
from flytekitplugins.ray import HeadNodeConfig, RayJobConfig, WorkerNodeConfig
from flytekitplugins.ray.task import RayFunctionTask

from relax.config import RelaxConfig, ResourcesConfig, load_config
from relax.pipeline import TrainSummary, train_run
from tasks.image import task_image

CLUSTER_ENV = "RELAX_CLUSTER_CONFIG"
DASHBOARD_ENV = "RELAX_RAY_DASHBOARD"
# shared by the registered tasks and the per-run copies the dynamic task makes
RAY_TASK = dict(retries=3, timeout=timedelta(hours=48), container_image=task_image())


def cluster_resources() -> ResourcesConfig:
    """What registered Ray tasks are sized by: ``$RELAX_CLUSTER_CONFIG`` (preset or file), else defaults."""
    source = os.environ.get(CLUSTER_ENV)
    return load_config(source).resources if source else RelaxConfig().resources


def _node(cpus: int, gpus: int, mem_gib: int) -> Resources:
    return Resources(cpu=str(cpus), mem=f"{mem_gib}Gi", gpu=str(gpus) if gpus else None)


def group_gpus(res: ResourcesConfig, group: str) -> int:
    """GPUs of one cluster: all of them, or a role group's share in the disaggregated topology."""
    if group == "rollout":
        return res.rollout_gpus or res.num_gpus // 2
    if group == "learner":
        return res.actor_gpus or res.num_gpus - (res.rollout_gpus or res.num_gpus // 2)
    return res.num_gpus


def role_gpus(res: ResourcesConfig, role: str) -> int:
    """GPUs the Ray actor of one disaggregated role asks for: the rollout and the actor get their
    group's GPUs, capped at the biggest node of that group's cluster (a Ray actor runs on one node;
    asking for more waits forever); the roles that feed or score them ask for none."""
    if role not in ("rollout", "actor"):
        return 0
    gpus = group_gpus(res, "rollout" if role == "rollout" else "learner")
    head = max(0, gpus - res.workers * res.gpus_per_worker)
    return min(gpus, max(head, res.gpus_per_worker if res.workers else 0))


def role_cpus(res: ResourcesConfig, roles: int) -> float:
    """CPUs each of ``roles`` role hosts asks Ray for: the most (at most 1) at which all of them fit on
    the cluster's nodes at once, node by node (a role left waiting for a CPU would stall the run).
    Rounded down to Ray's resolution of 1e-4, so a share of 2/3 really fits three times in 2 CPUs."""
    caps = [res.num_cpus] + [res.cpus_per_worker] * res.workers
    shares = sorted({min(1.0, math.floor(c / k * 10_000) / 10_000) for c in caps for k in range(1, roles + 1)},
                    reverse=True)
    return next(s for s in shares if s > 0 and sum(math.floor(c / s + 1e-9) for c in caps) >= roles)


class RelaxRayJobConfig(RayJobConfig):
    """A ``RayJobConfig`` whose tasks run by :class:`RelaxRayTask` (serialized exactly as the plugin's)."""


class RelaxRayTask(RayFunctionTask):
    """The Ray plugin's task, except that run locally (``pyflyte run`` without ``--remote``,
    ``make run``) it starts Ray without the dashboard, unless ``$RELAX_RAY_DASHBOARD=1``.

    Why: the plugin's local ``ray.init()`` starts the dashboard and its agent, which on a
    2-core machine took a fifth of every step of the main job (0.416 s a step against 0.34
    with Ray started without it; docs/history/learning-recipe.md). On a cluster KubeRay starts Ray, and
    this changes nothing."""

    def pre_execute(self, user_params):
        if FlyteContextManager.current_context().execution_state.is_local_execution():
            import ray

            if not ray.is_initialized():
                ray.init(include_dashboard=os.environ.get(DASHBOARD_ENV) == "1", ignore_reinit_error=True)
        return super().pre_execute(user_params)


TaskPlugins.register_pythontask_plugin(RelaxRayJobConfig, RelaxRayTask)


def ray_job_config(res: ResourcesConfig, group: str = "workers") -> RayJobConfig:
    """A KubeRay cluster for ``res``: a head with ``num_cpus`` CPUs and whatever GPUs the workers
    do not hold, plus one worker group of ``workers`` nodes (``cpus_per_worker``/``gpus_per_worker``),
    every node with ``memory_gib``. Requests equal limits so pods get the Guaranteed QoS class and
    are not the first evicted in the middle of a run. The group is kept even with 0 replicas, so a
    cluster preset only changes numbers, never the shape of the spec."""
    gpus = group_gpus(res, group)
    head_gpus = max(0, gpus - res.workers * res.gpus_per_worker)
    head = _node(res.num_cpus, head_gpus, res.memory_gib)
    worker = _node(res.cpus_per_worker, res.gpus_per_worker, res.memory_gib)
    return RelaxRayJobConfig(
        head_node_config=HeadNodeConfig(
            ray_start_params={"num-cpus": str(res.num_cpus), "num-gpus": str(head_gpus)},
            requests=head, limits=head),
        worker_node_config=[WorkerNodeConfig(
            group_name=group, replicas=res.workers,
            ray_start_params={"num-cpus": str(res.cpus_per_worker), "num-gpus": str(res.gpus_per_worker)},
            requests=worker, limits=worker)],
        shutdown_after_job_finishes=True,  # the cluster lives as long as the task, not longer
        ttl_seconds_after_finished=600,  # keep a failed cluster's logs readable for a while
    )


CLUSTER = cluster_resources()


@task(task_config=ray_job_config(CLUSTER), **RAY_TASK)
def train_step(cfg: RelaxConfig, init_checkpoint: str) -> TrainSummary:
    """Run (or resume) ``cfg``'s run to ``trainer.total_steps`` on one Ray cluster, starting from
    ``init_checkpoint`` ("" = the model of ``cfg.model``); returns the run's summary."""
    # a bar on a terminal, progress lines in a log (make run's, a cluster's)
    return train_run(cfg, init_checkpoint=init_checkpoint, progress=True)


def run_role_group(group: str, cfg: RelaxConfig) -> dict[str, int]:
    """Run the roles of ``group`` on the current Ray cluster until the run's last step, under the
    disaggregated controller (it restarts a role that dies); returns each role's attempts."""
    from relax.services.launchers.ray_role import ray_role_starter
    from relax.services.roles.factory import group_roles
    from relax.services.run_context import RunContext
    from relax.services.topologies.disaggregated import run_disaggregated

    ctx = RunContext(cfg)
    roles, res = group_roles(cfg, group), cfg.resources
    starter = ray_role_starter(ctx, gpus=lambda role: role_gpus(res, role), cpus=role_cpus(res, len(roles)))
    return run_disaggregated(ctx, progress=False, roles=roles, starter=starter)


@task(task_config=ray_job_config(CLUSTER, "rollout"), **RAY_TASK)
def rollout_group(cfg: RelaxConfig) -> dict[str, int]:
    """Disaggregated topology: the rollout role on its own Ray cluster; returns batches generated."""
    return run_role_group("rollout", cfg)


@task(task_config=ray_job_config(CLUSTER, "learner"), **RAY_TASK)
def learner_group(cfg: RelaxConfig) -> dict[str, int]:
    """Disaggregated topology: advantage + actor on their own Ray cluster; returns steps done."""
    return run_role_group("learner", cfg)


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"), container_image=task_image())
def start_run(cfg: RelaxConfig) -> str:
    """Disaggregated topology, before the role groups: create the run record (or check ``cfg`` against
    it) and fail early on data the trainer cannot train on; returns the run URL."""
    from relax.services.driver import prepare_run

    return prepare_run(cfg).run_url


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"), container_image=task_image())
def finish_run(cfg: RelaxConfig, run_url: str) -> TrainSummary:
    """Disaggregated topology, after the role groups: the run's summary and its report."""
    from relax.services.driver import summarize
    from relax.services.run_context import RunContext

    return summarize(RunContext(cfg))


def sized(t, res: ResourcesConfig, group: str = "workers"):
    """A copy of Ray task ``t`` for a cluster of ``res``. Same name and function, so a pod running it
    loads the registered task by name and runs the same code; only the cluster spec differs."""
    return task(task_config=ray_job_config(res, group), **RAY_TASK)(t.task_function)


def _local() -> bool:
    return FlyteContextManager.current_context().execution_state.is_local_execution()


@dynamic(retries=1, requests=Resources(cpu="1", mem="1Gi"), container_image=task_image())
def train(cfg: RelaxConfig, init_checkpoint: str) -> TrainSummary:
    """Launch the training Ray task(s) for ``cfg.topology``, each sized by ``cfg.resources``."""
    if cfg.topology != "disaggregated" or _local():
        return sized(train_step, cfg.resources)(cfg=cfg, init_checkpoint=init_checkpoint)
    # the roles know only cfg, so the starting checkpoint travels in it
    cfg = replace(cfg, model=replace(cfg.model, init_checkpoint=init_checkpoint or cfg.model.init_checkpoint))
    from relax.services.driver import run_finished
    from relax.services.run_context import RunContext

    ctx = RunContext(cfg)
    if run_finished(ctx):  # a rerun of a finished run: no Ray clusters for roles that would exit at once
        return finish_run(cfg=cfg, run_url=ctx.run_url)
    run_url = start_run(cfg=cfg)
    rollout = sized(rollout_group, cfg.resources, "rollout")(cfg=cfg)
    learner = sized(learner_group, cfg.resources, "learner")(cfg=cfg)
    run_url >> rollout
    run_url >> learner
    summary = finish_run(cfg=cfg, run_url=run_url)
    rollout >> summary
    learner >> summary
    return summary
