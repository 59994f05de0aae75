"""Dataset snapshot tasks.

Two steps so that Flyte's cache is keyed by the dataset's *content*: ``hash_dataset`` always
runs (the files behind a URL may have changed since the last run) and returns the content
hash; ``snapshot_dataset`` is cached on that hash, so an unchanged dataset is not rewritten
and a changed one always is.
"""

from __future__ import annotations

from flytekit import Cache, Resources, task

from relax.config import DataConfig, RelaxConfig
from relax.config_loader import validate
from relax.data.snapshot import SnapshotInfo
from relax.data.sources import plan_from_config, snapshot_from_config

SNAPSHOT_CACHE_VERSION = "1"  # bump when the snapshot layout changes


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"))
def hash_dataset(cfg: RelaxConfig) -> str:
    """Validate the whole config, then return the content id of its dataset (reads, writes nothing)."""
    validate(cfg)  # a config from `pyflyte run --cfg file.json` has not been through relax's loader
    return plan_from_config(cfg.data).id


@task(cache=Cache(version=SNAPSHOT_CACHE_VERSION), retries=2, requests=Resources(cpu="1", mem="2Gi"))
def snapshot_dataset(data: DataConfig, root: str, dataset_id: str) -> SnapshotInfo:
    """Write (or reuse) the snapshot ``dataset_id`` under ``root``; cached by content id."""
    info = snapshot_from_config(data, root)
    if info.id != dataset_id:
        raise RuntimeError(f"the dataset changed while the workflow ran ({dataset_id} -> {info.id}); run it again")
    print(f"dataset snapshot {info.id} at {info.url} rows={info.rows}", flush=True)
    return info
