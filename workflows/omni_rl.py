"""The main Relax pipeline: ``pyflyte run workflows/omni_rl.py omni_rl``.

Steps (later issues append training, evaluation and checkpoint registration here):
  1. hash the configured dataset and snapshot it under the run root, cached by content hash.

The input is the whole ``RelaxConfig`` (default: the ``tiny-cpu`` preset); from the CLI pass
``--cfg cfg.json`` (``relax config show --json > cfg.json`` writes one).
"""

from __future__ import annotations

from flytekit import workflow

from relax.config import RelaxConfig
from relax.data.snapshot import SnapshotInfo
from tasks.data import hash_dataset, snapshot_dataset


@workflow
def omni_rl(cfg: RelaxConfig = RelaxConfig()) -> SnapshotInfo:
    key = hash_dataset(cfg=cfg)
    return snapshot_dataset(data=cfg.data, key=key)
