"""Turn the ``data`` section of a config into train/eval splits and into a snapshot.

This is the one function the CLI, the Flyte task and later the trainer call, so that a
config always names exactly one dataset snapshot: the one ``data.snapshot`` names, as it was
written, or the one made from ``data.train_url`` (or the built-in suite).
"""

from __future__ import annotations

import hashlib
from typing import Any

from relax.config import DataConfig
from relax.config.preflight import check_root_writable
from relax.data.errors import DataError, Problems
from relax.data.readers import read_samples
from relax.data.samples import Sample
from relax.data.snapshot import (
    MediaLimits,
    Snapshot,
    SnapshotInfo,
    SnapshotPlan,
    list_snapshots,
    plan_snapshot,
    write_snapshot,
)
from relax.objstore import absolute_url, exists, join


def load_splits(data: DataConfig, problems: Problems | None = None) -> dict[str, list[Sample]]:
    """``{"train": [...], "eval": [...]}`` from the built-in suite or from data.train_url/eval_url.

    Every bad row of both files is met before anything is raised: with ``problems`` they (and a
    split left empty) are added there and the splits of the good rows returned, an empty split
    left out; without, one error lists them all."""
    if not data.train_url:
        from relax.data.suite import generate_suite

        return generate_suite(list(data.tasks), seed=data.seed, train_per_task=data.train_per_task,
                              eval_per_task=data.eval_per_task, difficulty=data.difficulty)
    own = problems is None
    problems = Problems() if own else problems
    train = list(read_samples(data.train_url, data.format, data.allow_remote_media, "train", problems))
    if data.eval_url:
        splits = {"train": train,
                  "eval": list(read_samples(data.eval_url, data.format, data.allow_remote_media, "eval", problems))}
    else:
        splits = {"train": [], "eval": []}
        for s in train:
            splits["eval" if held_out(s.id, data.eval_fraction) else "train"].append(s)
        for empty in [k for k, v in splits.items() if not v and train]:
            problems.add(f"splitting the {len(train)} rows of {data.train_url} with data.eval_fraction="
                         f"{data.eval_fraction} left the {empty} split empty; change data.eval_fraction or pass "
                         f"held-out rows in data.eval_url")
            del splits[empty]
    if own:
        problems.raise_if_any()
    return splits


def held_out(sample_id: str, fraction: float) -> bool:
    """A stable split by row id: the same row lands in the same split on every machine."""
    h = int.from_bytes(hashlib.sha256(sample_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


def source_description(data: DataConfig) -> dict[str, Any]:
    """What the snapshot was made from, kept in its manifest (not part of its id)."""
    if not data.train_url:
        return {"kind": "builtin", "tasks": list(data.tasks), "seed": data.seed, "difficulty": data.difficulty,
                "train_per_task": data.train_per_task, "eval_per_task": data.eval_per_task}
    return {"kind": "files", "format": data.format, "train_url": absolute_url(data.train_url),
            "eval_url": absolute_url(data.eval_url) if data.eval_url else "",
            "eval_fraction": data.eval_fraction if not data.eval_url else None}


def plan_from_config(data: DataConfig, progress: bool = False) -> SnapshotPlan:
    """The snapshot plan of ``data``; one DataError lists every problem of its rows and media."""
    if data.snapshot:
        raise DataError(f"data.snapshot={data.snapshot} is a snapshot already written; there is nothing to plan "
                        f"(open it with snapshot_from_config)")
    problems = Problems()
    return plan_snapshot(load_splits(data, problems), source_description(data), progress=progress,
                         limits=MediaLimits.from_config(data), problems=problems)


def snapshot_from_config(data: DataConfig, root: str, progress: bool = False) -> SnapshotInfo:
    """Create (or reuse) the snapshot of the dataset ``data`` describes under ``root``; with
    ``data.snapshot``, open that snapshot (it must exist under ``root``)."""
    if data.snapshot:
        return open_snapshot(data.snapshot, root).info()
    check_root_writable(root)  # before the rows are read: a wrong root is the cheaper thing to learn first
    return write_snapshot(plan_from_config(data, progress), root, progress=progress)


def open_snapshot(snapshot_id: str, root: str) -> Snapshot:
    """Snapshot ``snapshot_id`` under ``root``; a missing one is an error listing those that exist."""
    root = absolute_url(root)
    if not exists(join(root, "datasets", snapshot_id, "manifest.json")):
        present = list_snapshots(root)
        listed = f"snapshots there: {', '.join(present)}" if present else "there are no snapshots there"
        raise DataError(f"data.snapshot={snapshot_id}: no such snapshot under root {root} ({listed}); make it with "
                        f"`relax data snapshot FILE --root {root}`, or set root to where it was made")
    return Snapshot.open(root, snapshot_id)
