"""The driver of a run: ``train(cfg)`` runs one in the configured topology, resumable by running it again.

* ``colocated``: every role in this process (relax.services.topologies.colocated);
* ``async``: each role a Ray Serve deployment (relax.services.topologies.asynchronous);
* ``disaggregated``: each role an OS process (relax.services.topologies.disaggregated).

This driver moves no data: it checks the run, starts its roles in the chosen topology, and
exports the report (JSONL, TensorBoard events, PNG curves) at the end. The format warm-start is
not its job: ``relax.pipeline`` runs it first and hands its checkpoint in as ``model.init_checkpoint``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from relax import objstore
from relax.config import ConfigError, RelaxConfig
from relax.config.cross import check_warm_started
from relax.faults import FAULT_ENV, parse_faults
from relax.services.report.metrics import export_report, read_all_metrics
from relax.services.roles.actor import checkpoint_name, list_checkpoints
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from relax.services.topologies.asynchronous import run_async
from relax.services.topologies.colocated import run_colocated
from relax.services.topologies.disaggregated import run_disaggregated
from relax.services.trackers.feed import LiveFeed, start_feed, sync_run
from relax.services.trainable import check_trainable


@dataclass
class TrainSummary:
    """What a finished (or resumed-and-finished) run produced. A Flyte task output as well, so it
    holds figures and URLs only; :meth:`metrics` reads a role's records from the run."""

    run_url: str = ""
    run_id: str = ""
    steps: int = 0  # actor steps done in all (= the final policy version)
    checkpoint: str = ""  # the final checkpoint folder
    report_dir: str = ""  # curves.png, metrics.jsonl, events.out.tfevents.relax
    reward_first: float = 0.0  # mean training reward over the first tenth of the rollout batches
    reward_last: float = 0.0  # ... and over the last tenth

    def metrics(self, role: str) -> list[dict[str, Any]]:
        """Every metrics record of ``role`` in this run, oldest first (rollout batches carry the reward
        role's figures when it scored them)."""
        return read_all_metrics(self.run_url)[role]


def check_fault_spec() -> None:
    """A fault to inject (``RELAX_FAULT``, tests) that does not parse fails here, not in every role."""
    try:
        parse_faults(os.environ.get(FAULT_ENV, ""))
    except ValueError as e:
        raise ConfigError(str(e)) from None


def prepare_run(cfg: RelaxConfig, *, fork: bool = False, engine_urls: list[str] | None = None) -> RunContext:
    """Everything before a run's roles start, wherever they start (``relax train``, a Flyte task):
    the config checks, the trainability check, and the run record (created, or ``cfg`` checked against it)."""
    check_warm_started(cfg)
    check_fault_spec()
    ctx = RunContext(cfg)
    check_trainable(ctx, engine_urls)
    ensure_run(ctx, fork)
    return ctx


def train(cfg: RelaxConfig, *, fork: bool = False, progress: bool = True, engine_urls: list[str] | None = None,
          max_steps: int | None = None) -> TrainSummary:
    """Run (or resume) ``cfg``'s run to ``trainer.total_steps``; ``max_steps`` stops early (tests)."""
    ctx = prepare_run(cfg, fork=fork, engine_urls=engine_urls)
    live = start_feed(ctx)  # MLflow / W&B follow the metrics while the roles train
    try:
        if cfg.topology == "colocated":
            run_colocated(ctx, progress, engine_urls, max_steps)
        elif cfg.topology == "disaggregated":
            run_disaggregated(ctx, progress)
        else:
            run_async(ctx, progress, engine_urls)
    finally:
        if live is not None:
            live.stop()
    return summarize(ctx, live)


def run_finished(ctx: RunContext) -> bool:
    """Whether the run's actor wrote its final checkpoint: a rerun of it has nothing to train."""
    done = list_checkpoints(ctx)
    return bool(done) and done[-1] + 1 >= ctx.cfg.trainer.total_steps


def summarize(ctx: RunContext, live: LiveFeed | None = None) -> TrainSummary:
    """The summary of the run in ``ctx`` as its roles left it; writes its report (JSONL, TensorBoard, PNG)
    and sends the trackers what they have not got yet (a tracker that fails only warns)."""
    metrics = read_all_metrics(ctx.run_url)
    export_report(ctx.run_url, metrics, tensorboard="tensorboard" in ctx.cfg.report.trackers)
    sync_run(ctx, live)
    steps = max((m["step"] for m in metrics["actor"]), default=-1) + 1
    done = list_checkpoints(ctx)
    rewards = [m["reward"] for m in metrics["rollout"]]
    tenth = max(1, len(rewards) // 10)
    return TrainSummary(
        run_url=ctx.run_url, run_id=ctx.cfg.run_id, steps=steps,
        checkpoint=objstore.join(ctx.run_url, "checkpoints", checkpoint_name(done[-1])) if done else "",
        report_dir=objstore.join(ctx.run_url, "report"),
        reward_first=sum(rewards[:tenth]) / tenth if rewards else 0.0,
        reward_last=sum(rewards[-tenth:]) / tenth if rewards else 0.0)
