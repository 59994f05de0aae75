"""Scheduled retraining: the config of one nightly run, continuing from the newest checkpoint.

Not cached on purpose: "the newest checkpoint under the root" changes with every run.
"""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

from flytekit import Resources, task

from relax import pipeline
from relax.config import RelaxConfig
from tasks.image import task_image


def retrain_run_id(base: str, kickoff_time: datetime) -> str:
    """``<run_id>-YYYYmmdd-HHMM``: one run per schedule tick, and a retry of a tick resumes it."""
    return f"{base}-{kickoff_time:%Y%m%d-%H%M}"


@task(retries=2, requests=Resources(cpu="1", mem="1Gi"), container_image=task_image())
def retrain_config(cfg: RelaxConfig, kickoff_time: datetime) -> RelaxConfig:
    """The config of the run kicked off at ``kickoff_time``: its own run id, starting from the newest
    final checkpoint of any *other* run under ``cfg.root`` (so lineage continues across runs); the
    format warm-start is skipped then, as the policy already learned the format."""
    run_id = retrain_run_id(cfg.run_id, kickoff_time)
    # excluding this tick's own run keeps a retried tick's config (and so its run) unchanged
    latest = pipeline.latest_checkpoint(cfg.root, exclude_run=run_id)
    if not latest:
        print(f"{run_id}: no earlier checkpoint under {cfg.root}; starting from {cfg.model.name_or_path}")
        return replace(cfg, run_id=run_id)
    print(f"{run_id}: continuing from {latest}", flush=True)
    return replace(cfg, run_id=run_id, model=replace(cfg.model, init_checkpoint=latest),
                   trainer=replace(cfg.trainer, sft_steps=0))
