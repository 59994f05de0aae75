"""MLflow: one MLflow run per Relax run, and each final checkpoint a registered model version.

* Tracking URI ``report.mlflow_uri``, by default a SQLite database ``<root>/mlflow.db`` (a real
  database, shared by every run under the root, so chained runs land in one registry).
* The MLflow run holds the resolved config as params, the run's identity as tags, the dataset
  snapshot as a dataset input (its content id as the digest, its URL as the source) and every
  step's metrics (``actor/loss`` at actor step s, ``rollout/reward`` at rollout batch s, ...).
* A checkpoint becomes a version of ``report.registered_model`` (default ``relax-<model>``) whose
  source is the checkpoint folder and whose tags name its Relax run, dataset snapshot, parent
  checkpoint, where the run started from and the config hash; the format warm start it descends
  from becomes a version too, so ``search_model_versions`` shows snapshot -> run -> checkpoint.
"""

from __future__ import annotations

import json
import os
import re
import time
from typing import Any

from relax import objstore
from relax.config.tree import WARM_START_RUN
from relax.services.trackers.base import MetricRow, RunFacts, flat_params, parent_key, started_from
from relax.transfer.lineage import LineageRecord, chain_to_text

_PARAM_MAX = 6000  # MLflow's longest param value
_BATCH = 100  # params per log_batch call MLflow accepts


def default_uri(root: str) -> str:
    """``sqlite:///<root>/mlflow.db`` (a local root: the config checks refuse mlflow on a remote one without a URI)."""
    return "sqlite:///" + os.path.join(objstore.local_path(root) or os.path.abspath(".relax"), "mlflow.db")


def model_name(configured: str, model: str) -> str:
    """The registered model: ``configured``, else ``relax-<model's last path part>`` in MLflow's name characters."""
    return configured or "relax-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", model.rstrip("/").split("/")[-1])


class MlflowTracker:
    name = "mlflow"

    def __init__(self, report: Any, root: str):
        self.uri = report.mlflow_uri or default_uri(root)
        self.experiment = report.mlflow_experiment
        self.registered = report.registered_model
        # a server keeps its own artifacts; beside a SQLite file they go next to it, never into the cwd's ./mlruns
        db = self.uri[len("sqlite:///"):] if self.uri.startswith("sqlite:///") else ""
        self.artifacts = ("file://" + os.path.join(os.path.dirname(os.path.abspath(db)), "mlflow-artifacts")
                          if db else None)
        self.client: Any = None
        self.run_id = ""
        self.facts: RunFacts | None = None

    def open(self, facts: RunFacts, ids: dict[str, Any]) -> dict[str, Any]:
        # an unreachable server must fail in seconds, not after MLflow's default minutes of backoff
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "1")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow import MlflowClient

        self.facts = facts
        self.client = client = MlflowClient(tracking_uri=self.uri, registry_uri=self.uri)
        exp = client.get_experiment_by_name(self.experiment)
        eid = exp.experiment_id if exp else client.create_experiment(self.experiment, self.artifacts)
        run_id = ids.get("run_id", "") if ids.get("tracking_uri") == self.uri else ""
        if not run_id:  # the state file may be gone while the database keeps the run: find it by the run's URL
            found = client.search_runs([eid], f"tags.relax_run_url = '{facts.run_url}'", max_results=1)
            run_id = found[0].info.run_id if found else ""
        if run_id:
            client.update_run(run_id, status="RUNNING")
        else:
            run_id = self._create(eid, facts)
        self.run_id = run_id
        return {"tracking_uri": self.uri, "experiment_id": eid, "run_id": run_id}

    def _create(self, eid: str, facts: RunFacts) -> str:
        from mlflow.entities import Dataset, DatasetInput, InputTag, Param

        tags = {"relax_run_id": facts.run_id, "relax_run_url": facts.run_url, "relax_config_hash": facts.config_hash,
                "relax_code_version": facts.code_version, "relax_snapshot_id": facts.snapshot_id,
                "relax_model": facts.model, "mlflow.source.name": "relax"}
        run_id = self.client.create_run(eid, run_name=facts.run_id, tags=tags).info.run_id
        params = [Param(k, v[:_PARAM_MAX]) for k, v in sorted(flat_params(facts.config).items())]
        for i in range(0, len(params), _BATCH):
            self.client.log_batch(run_id, params=params[i:i + _BATCH])
        dataset = Dataset(name=f"snapshot-{facts.snapshot_id}", digest=facts.snapshot_id[:36],
                          source_type="relax-snapshot", source=json.dumps({"uri": facts.snapshot_url}))
        self.client.log_inputs(run_id, [DatasetInput(dataset, [InputTag("mlflow.data.context", "train")])])
        return run_id

    def log_metrics(self, rows: list[MetricRow]) -> None:
        from mlflow.entities import Metric

        metrics = [Metric(k, v, int(r.time * 1000), r.step) for r in rows for k, v in r.values.items()]
        for i in range(0, len(metrics), 1000):
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def log_checkpoint(self, head: LineageRecord, chain: list[LineageRecord]) -> None:
        assert self.facts is not None
        name = model_name(self.registered, self.facts.model)
        if not self.client.search_registered_models(f"name = '{name}'"):
            self.client.create_registered_model(name, description="Relax checkpoints (docs/tracking.md)")
        registered = {v.tags.get("relax_checkpoint") for v in self.client.search_model_versions(f"name = '{name}'")}
        for record in reversed(chain):  # the warm start first, so versions number in lineage order
            if record.run_id == WARM_START_RUN and record.key not in registered:
                self._register(name, record, [record], run_id=None)
        if head.key not in registered:
            self._register(name, head, chain, run_id=self.run_id)
        self.client.set_tag(self.run_id, "relax_checkpoint", head.key)
        self.client.log_text(self.run_id, chain_to_text(chain), f"lineage/{head.checkpoint}.txt")

    def _register(self, name: str, record: LineageRecord, chain: list[LineageRecord], run_id: str | None) -> None:
        tags = {"relax_checkpoint": record.key, "relax_run_id": record.run_id, "relax_step": str(record.step),
                "relax_snapshot_id": record.dataset_snapshot, "relax_parent_checkpoint": parent_key(record),
                "relax_started_from": started_from(chain), "relax_config_hash": record.config_hash,
                "relax_code_version": record.code_version}
        source = str(record.extra.get("checkpoint_url") or record.key)
        self.client.create_model_version(name, source, run_id=run_id, tags=tags, description=chain_to_text(chain))

    def close(self) -> None:
        if self.client is not None and self.run_id:
            self.client.set_terminated(self.run_id, "FINISHED", end_time=int(time.time() * 1000))
