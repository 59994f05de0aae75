"""``train(cfg)``: one run in the configured topology, resumable by running it again.

* ``colocated`` — the three roles in this process, time-sharing its CPUs/GPU: whichever role
  can make progress does (actor, then advantage, then rollout), so a resumed run first
  finishes the work already in the queue.
* ``async`` — each role is a Ray Serve deployment running its own loop (relax.services.deployments);
  generation overlaps training, bounded by ``queue.max_staleness``.
* ``disaggregated`` — each role is its own OS process (``relax role <name>``) that shares
  nothing with the others but the run root (a folder or a bucket); on a cluster each is a
  Flyte Ray task.

With ``algorithm.advantage=gae`` the critic (relax.services.critic) is a role of its own: its
own process (disaggregated) or deployment (async); colocated, it is stepped beside the
advantage role as one stage. With ``algorithm.reference_role`` so is the reference. The controller moves no data: it starts roles, follows the actor's metrics, and exports the
report (JSONL, TensorBoard events, PNG curves) at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from relax.config import RelaxConfig
from relax.config_loader import config_to_dict
from relax.services.context import RunContext
from relax.services.engine_launcher import kill_on_parent_death
from relax.services.metrics import MetricsLog, MetricsReader, export_report, read_all_metrics
from relax.transfer.errors import QueueTimeout


@dataclass
class TrainResult:
    run_url: str
    steps: int
    final_version: int
    report: dict[str, str] = field(default_factory=dict)
    rollout: list[dict[str, Any]] = field(default_factory=list)
    actor: list[dict[str, Any]] = field(default_factory=list)


class Progress:
    """A tqdm bar over actor steps: reward, staleness, samples/s."""

    def __init__(self, total: int, start: int, enabled: bool):
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not enabled,
                        dynamic_ncols=True)
        self.reward = float("nan")
        self.t0, self.samples = time.perf_counter(), 0

    def rollout(self, m: dict[str, Any]) -> None:
        self.reward = m.get("reward", self.reward)

    def actor(self, m: dict[str, Any]) -> None:
        self.samples += m.get("samples", 0)
        self.bar.set_postfix(reward=f"{self.reward:.3f}", stale=m.get("staleness_max", 0),
                             sps=f"{self.samples / max(time.perf_counter() - self.t0, 1e-9):.0f}", refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def train(cfg: RelaxConfig, *, fork: bool = False, progress: bool = True, engine_urls: list[str] | None = None,
          max_steps: int | None = None) -> TrainResult:
    """Run (or resume) ``cfg``'s run to ``trainer.total_steps``; ``max_steps`` stops early (tests)."""
    ctx = RunContext(cfg)
    ctx.check_trainable(engine_urls)
    ctx.ensure_run(fork)
    if cfg.topology == "colocated":
        run_colocated(ctx, progress, engine_urls, max_steps)
    elif cfg.topology == "disaggregated":
        run_disaggregated(ctx, progress)
    else:
        from relax.services.deployments import run_async

        run_async(ctx, progress, engine_urls)
    metrics = read_all_metrics(ctx.run_url)
    report = export_report(ctx.run_url, metrics)
    last = max((m["step"] for m in metrics["actor"]), default=-1)
    return TrainResult(ctx.run_url, last + 1, last + 1, report, metrics["rollout"], metrics["actor"])


def advantage_stage(ctx: RunContext, wait_s: float | None = 600.0) -> Any:
    """The colocated stage that puts advantages on the rows: the advantage role alone, or with
    PPO+GAE the critic beside it (relax.services.critic.CriticAndAdvantage), stepped as one."""
    if ctx.cfg.algorithm.advantage == "gae":
        from relax.services.critic import CriticAndAdvantage

        return CriticAndAdvantage(ctx, wait_s)
    from relax.services.advantage import AdvantageRole

    return AdvantageRole(ctx)


def role_names(cfg: RelaxConfig) -> tuple[str, ...]:
    """The roles a run starts as processes (disaggregated) or deployments (async), in start
    order: the actor publishes version 0 that the others wait for. The critic (PPO with GAE)
    and the reference (``algorithm.reference_role``) are roles of their own there."""
    return (("actor", "advantage", "rollout") + (("critic",) if cfg.algorithm.advantage == "gae" else ())
            + (("reference",) if cfg.algorithm.reference_role else ())
            + (("reward",) if cfg.data.reward_role else ()))


class RoleLogs:
    """One metrics log per role name, opened on its first record (a stage may report for two)."""

    def __init__(self, run_url: str):
        self.run_url, self.logs = run_url, {}

    def append(self, metrics: dict[str, Any]) -> None:
        role = metrics["role"]
        if role not in self.logs:
            self.logs[role] = MetricsLog(self.run_url, role)
        self.logs[role].append(metrics)


def run_colocated(ctx: RunContext, progress: bool = True, engine_urls: list[str] | None = None,
                  max_steps: int | None = None) -> None:
    from relax.services.actor import ActorRole
    from relax.services.rollout import RolloutRole

    actor = ActorRole(ctx)
    extra: list[Any] = []  # roles of their own (reference, reward), stepped after the advantage stage
    if ctx.cfg.algorithm.reference_role:
        from relax.services.reference import ReferenceRole

        extra.append(ReferenceRole(ctx))
    if ctx.cfg.data.reward_role:
        from relax.services.reward import RewardRole

        extra.append(RewardRole(ctx))
    adv = advantage_stage(ctx)
    rollout = RolloutRole(ctx, engine_urls)
    critic = adv.critic if ctx.cfg.algorithm.advantage == "gae" else None
    logs = RoleLogs(ctx.run_url)
    bar = Progress(ctx.cfg.trainer.total_steps, actor.step_index, progress)
    stop_at = ctx.cfg.trainer.total_steps if max_steps is None else min(ctx.cfg.trainer.total_steps, max_steps)

    def finished() -> bool:  # the critic also trains on the last batch, so its checkpoint covers the run
        return actor.step_index >= stop_at and (critic is None or critic.trained >= stop_at)

    try:
        while not finished():
            # whichever role can move without waiting does, downstream first
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


# -- disaggregated: one OS process per role ---------------------------------------------------
def role_command(role: str, cfg_path: str) -> list[str]:
    return [sys.executable, "-m", "relax.cli.main", "role", role, cfg_path]


def run_disaggregated(ctx: RunContext, progress: bool = True) -> None:
    """Start rollout, advantage and actor as separate processes and wait for all three."""
    with tempfile.TemporaryDirectory(prefix="relax-roles-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(ctx.cfg), f)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stderr to files, not pipes: a long run's warnings would fill a pipe nobody reads and block the role
        logs = {role: os.path.join(tmp, f"{role}.log") for role in role_names(ctx.cfg)}
        # this thread waits for the roles, so they die with it: a killed driver (Ctrl-C'd or SIGKILLed
        # `make run`, a Ray task whose owner died) leaves no role writing to the run it will resume
        procs = {role: subprocess.Popen(role_command(role, cfg_path), env=env, stdout=subprocess.DEVNULL,
                                        stderr=open(logs[role], "wb"), preexec_fn=kill_on_parent_death)
                 for role in logs}
        bar = Progress(ctx.cfg.trainer.total_steps, 0, progress)
        actor = MetricsReader(ctx.run_url, "actor")
        try:
            while True:
                running = [p for p in procs.values() if p.poll() is None]
                failed = [r for r, p in procs.items() if p.returncode not in (None, 0)]
                if failed:
                    with open(logs[failed[0]], errors="replace") as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"role {failed[0]} exited with {procs[failed[0]].returncode}: {tail}")
                for m in actor.new():
                    bar.actor(m)
                if not running:
                    break
                time.sleep(0.5)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            bar.close()


def role_threads(role: str, cfg: RelaxConfig) -> int:
    """Torch threads of a role in a process of its own: rollout and actor each get half the CPUs,
    so they overlap instead of contending. Retraining a step bit for bit needs the same count
    (``relax replay --retrain``): a float32 reduction split over other threads sums in another order."""
    return 1 if role in ("advantage", "reference", "critic", "reward") else max(1, cfg.resources.num_cpus // 2)


def run_role(role: str, cfg: RelaxConfig, timeout_s: float = 600.0, engine_urls: list[str] | None = None,
             on_step: Any = None, on_start: Any = None, api_mode: str = "thread") -> int:
    """The loop of one role in this process until the run's last step; returns steps done.
    ``on_start(role_object)`` once it is built; ``api_mode`` goes to the rollout role."""
    import torch

    from relax.services.actor import ActorRole
    from relax.services.rollout import RolloutRole

    torch.set_num_threads(role_threads(role, cfg))
    ctx = RunContext(cfg)
    total = cfg.trainer.total_steps
    if role == "rollout":
        obj: Any = RolloutRole(ctx, engine_urls, api_mode=api_mode)
    elif role == "actor":
        obj = ActorRole(ctx)
    elif role == "reference":
        from relax.services.reference import ReferenceRole

        obj = ReferenceRole(ctx, wait_s=timeout_s)
    elif role == "reward":
        from relax.services.reward import RewardRole

        obj = RewardRole(ctx)
    elif role == "critic":
        from relax.services.critic import CriticRole

        obj = CriticRole(ctx, wait_s=timeout_s)
    else:  # with PPO+GAE the advantage role waits for the critic's values (the critic role's column)
        from relax.services.advantage import AdvantageRole

        obj = AdvantageRole(ctx)
    if on_start is not None:
        on_start(obj)
    log = RoleLogs(ctx.run_url)
    done = 0
    try:
        while not _role_done(role, obj, total):
            m = obj.step(timeout=timeout_s)
            log.append(m)
            if on_step is not None:
                on_step(m)
            done += 1
    finally:
        obj.close()
    return done


def _role_done(role: str, obj: Any, total: int) -> bool:
    if role == "actor":
        return obj.step_index >= total
    if role in ("advantage", "reference", "critic", "reward"):
        return obj.done
    return obj.batch >= total
