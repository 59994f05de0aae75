"""Weights & Biases: one W&B run per Relax run, offline unless ``report.wandb_mode=online``.

Offline (the default: no network, no login) the run's files go to ``<run>/report/wandb`` (a
local root; else ``./.relax-wandb/<run_id>``) and ``wandb sync`` uploads them later. The W&B run
id is derived from the Relax run's URL and kept in the run root, so a resumed run continues it.
Each role's metrics are plotted against its own step (``actor/step``, ``rollout/step``, ...).

A checkpoint and the dataset snapshot become artifacts (``model`` and ``dataset``) that
reference their folders, with the lineage (snapshot, run, parent checkpoint, where the run
started from, config hash) in their metadata. W&B records an artifact as a run's input only
online (``use_artifact`` is refused offline), so online the run also uses the snapshot and the
parent checkpoint's artifact, and the W&B lineage graph draws the edges.
"""

from __future__ import annotations

import hashlib
import os
import re
from typing import Any

from relax import objstore
from relax.services.report.metrics import ROLES
from relax.services.trackers.base import MetricRow, RunFacts, parent_key, started_from
from relax.transfer.lineage import LineageRecord


def artifact_name(kind: str, key: str) -> str:
    """An artifact name W&B accepts (letters, digits, '-', '_', '.')."""
    return f"{kind}-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", key)


class WandbTracker:
    name = "wandb"

    def __init__(self, report: Any, run_url: str):
        self.project, self.mode = report.wandb_project, report.wandb_mode
        local = objstore.local_path(run_url)
        self.dir = os.path.join(local, "report", "wandb") if local else os.path.abspath(
            os.path.join(".relax-wandb", run_url.rstrip("/").split("/")[-1]))
        self.run: Any = None
        self.facts: RunFacts | None = None

    def open(self, facts: RunFacts, ids: dict[str, Any]) -> dict[str, Any]:
        import wandb

        self.facts = facts
        wid = ids.get("id") or hashlib.sha256(facts.run_url.encode()).hexdigest()[:16]
        os.makedirs(self.dir, exist_ok=True)
        self.run = wandb.init(project=self.project, id=wid, name=facts.run_id, resume="allow", dir=self.dir,
                              mode=self.mode, config=facts.config, reinit="create_new",
                              tags=[f"snapshot:{facts.snapshot_id}", f"config:{facts.config_hash}"],
                              settings=wandb.Settings(console="off", silent=True))
        for role in ROLES:
            self.run.define_metric(f"{role}/step")
            self.run.define_metric(f"{role}/*", step_metric=f"{role}/step")
        self.run.summary.update({"relax/run_url": facts.run_url, "relax/snapshot_id": facts.snapshot_id,
                                 "relax/code_version": facts.code_version})
        return {"id": wid, "dir": self.dir}

    def log_metrics(self, rows: list[MetricRow]) -> None:
        for r in rows:
            self.run.log({**r.values, f"{r.role}/step": r.step})

    def log_checkpoint(self, head: LineageRecord, chain: list[LineageRecord]) -> None:
        import wandb

        assert self.facts is not None
        snapshot = wandb.Artifact(artifact_name("snapshot", self.facts.snapshot_id), type="dataset",
                                  metadata={"snapshot_id": self.facts.snapshot_id, "url": self.facts.snapshot_url})
        snapshot.add_reference(self.facts.snapshot_url, checksum=False)
        model = wandb.Artifact(artifact_name("checkpoint", head.key), type="model", metadata={
            "checkpoint": head.key, "run_id": head.run_id, "step": head.step, "snapshot_id": head.dataset_snapshot,
            "parent_checkpoint": parent_key(head), "started_from": started_from(chain),
            "config_hash": head.config_hash, "code_version": head.code_version,
            "chain": [r.key for r in chain]})
        model.add_reference(str(head.extra.get("checkpoint_url") or objstore.join(
            self.facts.run_url, "checkpoints", head.checkpoint)), checksum=False)
        if self.mode == "online":
            self.run.use_artifact(snapshot)
            parent = started_from(chain)
            if parent:
                try:  # an earlier run's checkpoint is an artifact only if that run logged it to W&B
                    self.run.use_artifact(f"{artifact_name('checkpoint', parent)}:latest")
                except Exception:
                    pass
        else:
            self.run.log_artifact(snapshot)
        self.run.log_artifact(model, aliases=["latest", f"step-{head.step}"])
        self.run.summary.update({"relax/checkpoint": head.key, "relax/parent_checkpoint": parent_key(head),
                                 "relax/started_from": started_from(chain)})

    def close(self) -> None:
        if self.run is not None:
            import wandb

            self.run.finish()
            self.run = None
            # finish() may return before W&B's service has written the run's file (seen in CI: a run file
            # holding its header only); teardown waits for the service, which the next init restarts
            wandb.teardown()
