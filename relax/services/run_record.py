"""A run's record, ``<root>/runs/<run_id>/run.json``: written once, by the first process of a run.

A later start with the same run id must carry the same config (apart from the settings of how a
run is operated, :data:`RESUMABLE_FIELDS`, such as ``trainer.total_steps``, which may grow to
extend a run); a different config is refused unless the caller forks.
"""

from __future__ import annotations

import json
import time
from dataclasses import fields
from typing import Any

from relax import objstore
from relax.config import RelaxConfig, SupervisorConfig, config_to_dict, saved_config
from relax.config.report import ReportConfig
from relax.services.run_context import RunContext
from relax.transfer.lineage import code_version

# how a run is operated, not what it computes: a rerun may change them
RESUMABLE_FIELDS = {"trainer.total_steps", "rollout.api_port", "rollout.api_host", "rollout.max_engine_processes",
                    # the judge's pool size and API (its weights are checked apart: relax.services.judge_record)
                    "genrm.engines", "genrm.max_engines", "genrm.api_port", "genrm.allow_change",
                    *(f"supervisor.{f.name}" for f in fields(SupervisorConfig)),
                    *(f"report.{f.name}" for f in fields(ReportConfig)),  # where metrics go, not what they are
                    # a checkpoint, gathered or sharded, loads by Hugging Face name at any layout
                    "trainer.data_parallel", "trainer.tensor_parallel", "trainer.pipeline_parallel",
                    "trainer.context_parallel", "trainer.checkpoint_format"}


class RunConfigMismatch(ValueError):
    pass


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def ensure_run(ctx: RunContext, fork: bool = False) -> dict[str, Any]:
    """Create ``run.json`` or check ``ctx.cfg`` against it; returns the record."""
    cfg = ctx.cfg
    url = objstore.join(ctx.run_url, "run.json")
    if objstore.exists(url):
        record = json.loads(objstore.read_bytes(url))
        saved = _flat(saved_config(record["config"]))
        mine = _flat(config_to_dict(cfg))
        # A setting added to Relax after the run started is absent from run.json; at its
        # default it changes nothing, so upgrading Relax does not orphan a run.
        defaults = _flat(config_to_dict(RelaxConfig()))
        diff = sorted(k for k in set(saved) | set(mine)
                      if k not in RESUMABLE_FIELDS and saved.get(k) != mine.get(k)
                      and not (k not in saved and mine.get(k) == defaults.get(k)))
        if diff and not fork:
            shown = ", ".join(f"{k}: {saved.get(k)!r} -> {mine.get(k)!r}" for k in diff[:5])
            raise RunConfigMismatch(
                f"run {cfg.run_id!r} at {ctx.run_url} was started with a different config ({shown}); "
                f"use a new run_id, restore those values, or fork it (relax train --fork) to start a new "
                f"run from its latest checkpoint")
        return record
    record = {"run_id": cfg.run_id, "config": config_to_dict(cfg), "code_version": code_version(),
              "dataset_snapshot": ctx.snapshot_info.id, "created_at": time.time()}
    objstore.write_bytes(url, json.dumps(record, indent=1, sort_keys=True).encode())
    return record
