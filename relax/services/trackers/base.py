"""What every experiment tracker is given: the run's facts, its metric rows, its checkpoints.

A tracker (:class:`Tracker`) is fed by :mod:`relax.services.trackers.feed` from the metrics the
roles already append under ``<run>/metrics/`` and from the lineage records the actor writes, so
no role knows trackers exist and any tracker can be filled in afterwards from the same files.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

from relax.transfer.lineage import LineageRecord

# the step axis of each role's records (rollout: the batch it generated; the others: their step)
STEP_KEYS = {"rollout": "batch"}
# bookkeeping fields of a record that are not measurements
_NOT_METRICS = {"time", "step", "batch", "role", "version", "weight_version", "attempt"}


@dataclass
class RunFacts:
    """Who the run is: what a tracker names it by and files under it."""

    run_id: str
    run_url: str
    root: str
    config: dict[str, Any]  # the resolved config, nested
    config_hash: str
    code_version: str
    snapshot_id: str
    snapshot_url: str
    model: str  # model.name_or_path


@dataclass
class MetricRow:
    """One record of one role: its step, wall time, and its numeric fields as ``<role>/<name>``."""

    role: str
    step: int
    time: float
    values: dict[str, float] = field(default_factory=dict)


class Tracker(Protocol):
    """One experiment tracker. Every method may raise: the feed turns a failure into a warning
    and a retry, so a tracker that is down never stops training."""

    name: str

    def open(self, facts: RunFacts, state: dict[str, Any]) -> dict[str, Any]:
        """Start the tracker's run, or continue the one ``state`` names (what an earlier ``open``
        returned, kept in the run root); returns the state to keep."""

    def log_metrics(self, rows: list[MetricRow]) -> None:
        """Log ``rows`` (one role's, oldest step first; each step is sent once)."""

    def log_checkpoint(self, head: LineageRecord, chain: list[LineageRecord]) -> None:
        """Record the checkpoint ``head`` with its lineage (``chain``: head first, then its parents);
        a second call for the same checkpoint changes nothing."""

    def close(self) -> None:
        """Flush and end the tracker's run."""


def metric_rows(role: str, records: list[dict[str, Any]]) -> list[MetricRow]:
    """``role``'s metrics records as rows, one per step (a step logged twice, by a role that was
    restarted and redid it, keeps its last record), oldest step first."""
    key = STEP_KEYS.get(role, "step")
    by_step: dict[int, MetricRow] = {}
    for r in records:
        if key not in r:
            continue
        values = {f"{role}/{k}": float(v) for k, v in r.items()
                  if k not in _NOT_METRICS and isinstance(v, (int, float)) and not isinstance(v, bool)
                  and math.isfinite(float(v))}
        by_step[int(r[key])] = MetricRow(role, int(r[key]), float(r["time"]), values)
    return [by_step[s] for s in sorted(by_step)]


def flat_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """The nested config as ``section.field -> text`` (what MLflow params and W&B config hold)."""
    out: dict[str, str] = {}
    for k, v in config.items():
        if isinstance(v, dict):
            out.update(flat_params(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = str(v)
    return out


def parent_key(record: LineageRecord) -> str:
    """``run/checkpoint`` of the record's parent, "" for none."""
    return str(record.parent) if record.parent is not None else ""


def started_from(chain: list[LineageRecord]) -> str:
    """The first checkpoint outside the head's run that its chain reaches (an earlier run's checkpoint
    or the format warm start), "" when the run started from the model as built."""
    head = chain[0]
    for r in chain[1:]:
        if r.run_id != head.run_id:
            return r.key
    return ""
