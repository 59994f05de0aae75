"""The run record: created once, a different config is refused naming the field, total_steps may grow."""

from __future__ import annotations

import dataclasses
import json

import pytest

from relax import objstore
from relax.services.context import RunConfigMismatch, RunContext
from tests.relax.services.runtime_helpers import tiny_config


def test_run_record_written_then_checked(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}")
    ctx = RunContext(cfg)
    record = ctx.ensure_run()
    saved = json.loads(objstore.read_bytes(objstore.join(ctx.run_url, "run.json")))
    assert saved["dataset_snapshot"] == record["dataset_snapshot"] == ctx.snapshot_info.id
    assert saved["config"]["rollout"]["n_samples_per_prompt"] == 4

    longer = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, total_steps=40))
    RunContext(longer).ensure_run()  # extending a run is allowed

    other = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, lr=0.5))
    with pytest.raises(RunConfigMismatch, match=r"trainer\.lr: 0\.001 -> 0\.5.*fork"):
        RunContext(other).ensure_run()
    RunContext(other).ensure_run(fork=True)  # the user asked for it


def test_a_setting_added_after_the_run_started_is_compared_by_its_default(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}")
    ctx = RunContext(cfg)
    ctx.ensure_run()
    # rewrite run.json as an older Relax would have: without rollout.engine_timeout_s
    url = objstore.join(ctx.run_url, "run.json")
    record = json.loads(objstore.read_bytes(url))
    del record["config"]["rollout"]["engine_timeout_s"]
    objstore.write_bytes(url, json.dumps(record).encode())
    RunContext(cfg).ensure_run()  # at its default: the same run
    changed = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, engine_timeout_s=5.0))
    with pytest.raises(RunConfigMismatch, match=r"rollout\.engine_timeout_s: None -> 5\.0"):
        RunContext(changed).ensure_run()
