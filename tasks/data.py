"""Dataset snapshot tasks.

Two steps so that Flyte's cache is keyed by the dataset's *content* and its *place*:
``hash_dataset`` always runs (the files behind a URL may have changed since the last run)
and returns the content id with the absolute root; ``snapshot_dataset`` is cached on that
key, so an unchanged dataset is not rewritten, a changed one always is, and a run from
another folder (a different ``./.relax``) never gets a snapshot that lives elsewhere.
If a root was deleted by hand, rerun with ``pyflyte run --overwrite-cache``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from flytekit import Cache, Resources, task

from relax.config import DataConfig, RelaxConfig, validate
from relax.data.snapshot import SnapshotInfo
from relax.data.sources import open_snapshot, plan_from_config, snapshot_from_config
from relax.objstore import absolute_url

SNAPSHOT_CACHE_VERSION = "1"  # bump when the snapshot layout changes


@dataclass
class DatasetKey:
    """What the snapshot cache is keyed on: the content id and the absolute root it goes under."""

    id: str = ""
    root: str = ""


@task(retries=2, requests=Resources(cpu="1", mem="2Gi"))
def hash_dataset(cfg: RelaxConfig) -> DatasetKey:
    """Validate the whole config, then return its dataset's content id (reads, writes nothing)."""
    validate(cfg)  # a config from `pyflyte run --cfg file.json` has not been through relax's loader
    if cfg.data.snapshot:  # written already: its id is its content
        return DatasetKey(id=open_snapshot(cfg.data.snapshot, cfg.root).id, root=absolute_url(cfg.root))
    return DatasetKey(id=plan_from_config(cfg.data).id, root=absolute_url(cfg.root))


@task(cache=Cache(version=SNAPSHOT_CACHE_VERSION), retries=2, requests=Resources(cpu="1", mem="2Gi"))
def snapshot_dataset(data: DataConfig, key: DatasetKey) -> SnapshotInfo:
    """Write (or reuse) snapshot ``key.id`` under ``key.root``; cached on the key."""
    info = snapshot_from_config(data, key.root)
    if info.id != key.id:
        raise RuntimeError(f"the dataset changed while the workflow ran ({key.id} -> {info.id}); run it again")
    print(f"dataset snapshot {info.id} at {info.url} rows={info.rows}", flush=True)
    return info


@task(requests=Resources(cpu="1", mem="1Gi"))
def pin_root(cfg: RelaxConfig, key: DatasetKey) -> RelaxConfig:
    """Return ``cfg`` with its root made absolute (``key.root``). Later tasks are cached on the config,
    so a relative root (the default ``./.relax``) would let a run from another folder hit this one's
    cache and get URLs that live elsewhere."""
    return replace(cfg, root=key.root)
