"""Trackers fed from real short runs: MLflow on a SQLite store under tmp, W&B offline files."""

from __future__ import annotations

import dataclasses
import json
import logging
import socket

import pytest

from relax import objstore
from relax.pipeline import latest_checkpoint, train_run
from relax.services.driver import train
from relax.services.run_context import RunContext
from relax.services.trackers.feed import sync_run
from relax.transfer.lineage import chain
from tests.relax.services.runtime_helpers import tiny_config

pytest.importorskip("mlflow")
from mlflow import MlflowClient  # noqa: E402

MODEL = "relax-tiny-qwen2"


def _cfg(root, run_id, *overrides):
    return tiny_config(f"file://{root}", run_id, "trainer.total_steps=3", "report.trackers=[mlflow]", *overrides)


def _client(root) -> MlflowClient:
    return MlflowClient(f"sqlite:///{root}/mlflow.db")


def _runs(client):
    return client.search_runs([client.get_experiment_by_name("relax").experiment_id])


def _steps(client, run_id, key):
    return [m.step for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)]


def test_a_run_logs_every_step_and_a_resume_continues_the_same_mlflow_run(tmp_path):
    cfg = _cfg(tmp_path, "a")
    first = train(cfg, progress=False)
    client = _client(tmp_path)
    (run,) = _runs(client)
    assert _steps(client, run.info.run_id, "actor/loss") == [0, 1, 2]
    assert _steps(client, run.info.run_id, "rollout/reward") == [0, 1, 2]
    # system metrics ride on the same records: each role process's peak memory, every step
    assert _steps(client, run.info.run_id, "actor/sys_peak_rss_mb") == [0, 1, 2]
    assert run.data.metrics["actor/sys_peak_rss_mb"] > 50  # a process that imported torch
    assert run.data.params["trainer.total_steps"] == "3" and run.data.tags["relax_run_id"] == "a"
    snapshot = RunContext(cfg).snapshot_info
    (dataset,) = run.inputs.dataset_inputs
    assert dataset.dataset.digest == snapshot.id and snapshot.url in dataset.dataset.source
    (version,) = client.search_model_versions(f"name = '{MODEL}'")
    head = chain(cfg.root, "a")[0]
    assert version.source == first.checkpoint and version.run_id == run.info.run_id
    assert version.tags["relax_checkpoint"] == "a/step-000002" == head.key
    assert version.tags["relax_snapshot_id"] == snapshot.id
    assert version.tags["relax_parent_checkpoint"] == str(head.parent) == "a/step-000001"
    assert version.tags["relax_config_hash"] == head.config_hash

    # extending the run (total_steps may grow) continues the same MLflow run: steps 3, 4 added, none twice
    longer = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=5))
    assert train(longer, progress=False).steps == 5
    (again,) = _runs(client)
    assert again.info.run_id == run.info.run_id and again.info.status == "FINISHED"
    assert _steps(client, run.info.run_id, "actor/loss") == [0, 1, 2, 3, 4]
    assert _steps(client, run.info.run_id, "rollout/reward") == [0, 1, 2, 3, 4]
    versions = {v.tags["relax_checkpoint"]: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    assert set(versions) == {"a/step-000002", "a/step-000004"}
    assert versions["a/step-000004"].tags["relax_parent_checkpoint"] == "a/step-000003"
    # a sync with nothing new sends nothing and registers nothing twice
    assert sync_run(RunContext(longer))
    assert _steps(client, run.info.run_id, "actor/loss") == [0, 1, 2, 3, 4]
    assert len(client.search_model_versions(f"name = '{MODEL}'")) == 2


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again when the block ends: nothing listens there


def test_an_unreachable_tracker_warns_and_the_run_stays_green_then_sync_reconciles(tmp_path, caplog):
    down = f"http://127.0.0.1:{_closed_port()}"
    cfg = _cfg(tmp_path, "down", f"report.mlflow_uri={down}")
    with caplog.at_level(logging.WARNING, logger="relax.services.trackers.feed"):
        summary = train(cfg, progress=False)
    assert summary.steps == 3 and summary.checkpoint.endswith("step-000002")
    warned = [r.getMessage() for r in caplog.records if r.name == "relax.services.trackers.feed"]
    assert len(warned) == 1 and warned[0].startswith("tracker mlflow failed to log metrics (MlflowException")
    assert "Training goes on" in warned[0] and f"relax report sync {cfg.root} down" in warned[0]
    # the tracker is back (here: another store): `relax report sync` sends every step and the checkpoint
    up = dataclasses.replace(cfg, report=dataclasses.replace(cfg.report, mlflow_uri=f"sqlite:///{tmp_path}/up.db"))
    assert sync_run(RunContext(up))
    client = MlflowClient(f"sqlite:///{tmp_path}/up.db")
    (run,) = _runs(client)
    assert _steps(client, run.info.run_id, "actor/loss") == [0, 1, 2]
    assert [v.tags["relax_checkpoint"] for v in client.search_model_versions(f"name = '{MODEL}'")] == [
        "down/step-000002"]


def test_chained_runs_show_snapshot_warm_start_run_checkpoint_in_the_registry(tmp_path):
    # the nightly continuation: run b starts from run a's final checkpoint; run a from the format warm start
    cfg = _cfg(tmp_path, "a", "trainer.sft_steps=2")
    first = train_run(cfg, progress=False)
    second = dataclasses.replace(_cfg(tmp_path, "b"), trainer=dataclasses.replace(cfg.trainer, sft_steps=0))
    start = latest_checkpoint(cfg.root, exclude_run="b")
    assert start == first.checkpoint
    last = train_run(second, init_checkpoint=start, progress=False)
    client = _client(tmp_path)
    snapshot = RunContext(cfg).snapshot_info.id
    versions = {v.tags["relax_checkpoint"]: v for v in client.search_model_versions(f"name = '{MODEL}'")}
    warm = next(k for k in versions if k.startswith("warm-start/"))
    assert set(versions) == {warm, "a/step-000002", "b/step-000002"}
    assert {v.tags["relax_snapshot_id"] for v in versions.values()} == {snapshot}
    assert versions["b/step-000002"].tags["relax_started_from"] == "a/step-000002"
    assert versions["a/step-000002"].tags["relax_started_from"] == warm
    assert versions[warm].tags["relax_parent_checkpoint"] == "" and versions[warm].tags["relax_step"] == "2"
    runs = {r.data.tags["relax_run_id"]: r for r in _runs(client)}
    assert versions["b/step-000002"].run_id == runs["b"].info.run_id and last.checkpoint == versions[
        "b/step-000002"].source
    assert [d.dataset.digest for d in runs["b"].inputs.dataset_inputs] == [snapshot]
    # relax lineage follows the same chain down to the warm start
    assert [r.key for r in chain(cfg.root, "b")] == ["b/step-000002", "b/step-000001", "a/step-000002",
                                                      "a/step-000001", warm]


def test_wandb_offline_files_hold_the_metrics_and_the_checkpoint_artifact(tmp_path):
    pytest.importorskip("wandb")
    cfg = tiny_config(f"file://{tmp_path}", "w", "trainer.total_steps=2", "report.trackers=[wandb]")
    summary = train(cfg, progress=False)
    state = json.loads(objstore.read_bytes(objstore.join(summary.report_dir, "trackers", "wandb.json")))
    assert state["cursor"]["actor"] == 1 and state["logged"] == ["w/step-000001"]
    runs = list((tmp_path / "runs" / "w" / "report" / "wandb" / "wandb").glob(f"offline-run-*-{state['ids']['id']}"))
    assert len(runs) == 1
    data = (runs[0] / f"run-{state['ids']['id']}.wandb").read_bytes()
    assert b"actor/loss" in data and b"rollout/reward" in data
    assert b"checkpoint-w-step-000001" in data and RunContext(cfg).snapshot_info.id.encode() in data
