"""Lineage records: which dataset snapshot, samples, config and code made each checkpoint.

Why: a run must be traceable from any checkpoint back to what produced it, across
restarts and across runs (scheduled retraining starts from an earlier run's checkpoint).
Each checkpoint gets one small immutable JSON record, written next to the run::

    <root>/runs/<run_id>/lineage/<checkpoint>.json

A record names its parent checkpoint (same run, or an earlier run), so following parents
gives the whole history back to the first checkpoint, whatever store the root is on.
Records are write-once: rewriting identical content is a no-op, different content is
refused, so history cannot be silently rewritten. Every run has one writer (its trainer),
so the check-then-write below needs no lock.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from relax import objstore
from relax.config.tree import WARM_START_RUN

FORMAT_VERSION = 1
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_FIELDS = ("format_version", "run_id", "checkpoint", "step", "parent", "dataset_snapshot", "config_hash",
           "code_version", "manifest_versions", "samples_by_policy_version", "created_at", "extra")


class LineageError(ValueError):
    """A lineage record is malformed, missing, conflicting, or its parents form a cycle."""


@dataclass(frozen=True)
class ParentRef:
    """The checkpoint training resumed from: the previous one of the same run, or one of an earlier run."""

    run_id: str
    checkpoint: str

    def __str__(self) -> str:
        return f"{self.run_id}/{self.checkpoint}"


@dataclass
class LineageRecord:
    """One checkpoint's provenance. Validated on construction, so an invalid record never exists."""

    run_id: str
    checkpoint: str
    step: int
    parent: ParentRef | None
    dataset_snapshot: str
    config_hash: str
    code_version: str
    manifest_versions: dict[str, int] = field(default_factory=dict)
    samples_by_policy_version: dict[int, int] = field(default_factory=dict)
    created_at: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_name("run_id", self.run_id)
        _check_name("checkpoint", self.checkpoint)
        _check_count("step", self.step)
        if self.parent is not None:
            if not isinstance(self.parent, ParentRef):
                raise LineageError(f"field 'parent' must be a ParentRef or None, got {self.parent!r}")
            _check_name("parent.run_id", self.parent.run_id)
            _check_name("parent.checkpoint", self.parent.checkpoint)
            if (self.parent.run_id, self.parent.checkpoint) == (self.run_id, self.checkpoint):
                raise LineageError(f"record {self.key} names itself as its parent")
        for name in ("dataset_snapshot", "config_hash", "code_version"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise LineageError(f"field {name!r} must be a non-empty string, got {value!r}")
        _check_mapping("manifest_versions", self.manifest_versions, key_type=str)
        _check_mapping("samples_by_policy_version", self.samples_by_policy_version, key_type=int)
        ok_time = isinstance(self.created_at, (int, float)) and not isinstance(self.created_at, bool)
        if not ok_time or not math.isfinite(self.created_at) or self.created_at < 0:
            raise LineageError(f"field 'created_at' must be a unix time (seconds >= 0), got {self.created_at!r}")
        if not isinstance(self.extra, dict):
            raise LineageError(f"field 'extra' must be an object, got {type(self.extra).__name__}")

    @property
    def key(self) -> str:
        """``run_id/checkpoint``: how records name each other in messages and graphs."""
        return f"{self.run_id}/{self.checkpoint}"

    @property
    def sample_count(self) -> int:
        """Samples trained on since the parent checkpoint, over all policy versions."""
        return sum(self.samples_by_policy_version.values())

    @property
    def policy_range(self) -> tuple[int, int] | None:
        """Oldest and newest policy version that produced a trained sample; None without samples."""
        versions = [v for v, n in self.samples_by_policy_version.items() if n > 0]
        return (min(versions), max(versions)) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "run_id": self.run_id,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "parent": None if self.parent is None else {"run_id": self.parent.run_id,
                                                        "checkpoint": self.parent.checkpoint},
            "dataset_snapshot": self.dataset_snapshot,
            "config_hash": self.config_hash,
            "code_version": self.code_version,
            "manifest_versions": dict(sorted(self.manifest_versions.items())),
            # JSON object keys are strings; from_dict turns them back into ints.
            "samples_by_policy_version": {str(v): n for v, n in sorted(self.samples_by_policy_version.items())},
            "created_at": self.created_at,
            "extra": self.extra,
        }

    def to_json(self) -> str:
        try:
            return json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n"
        except (TypeError, ValueError) as e:
            raise LineageError(f"record {self.key}: field 'extra' is not JSON-serialisable: {e}") from e

    @classmethod
    def from_dict(cls, data: Any) -> LineageRecord:
        if not isinstance(data, dict):
            raise LineageError(f"a lineage record must be a JSON object, got {type(data).__name__}")
        version = data.get("format_version", FORMAT_VERSION)
        if version != FORMAT_VERSION:
            raise LineageError(f"format_version {version!r} is not supported (this Relax reads "
                               f"{FORMAT_VERSION}); upgrade Relax to read it")
        unknown = sorted(set(data) - set(_FIELDS))
        if unknown:
            raise LineageError(f"unknown field(s) {', '.join(map(repr, unknown))}; free-form data belongs "
                               f"under 'extra'")
        missing = [k for k in _FIELDS if k not in data and k not in ("format_version", "extra")]
        if missing:
            raise LineageError(f"missing field(s) {', '.join(map(repr, missing))}")
        parent = data["parent"]
        if parent is not None:
            if not isinstance(parent, dict) or set(parent) != {"run_id", "checkpoint"}:
                raise LineageError(f"field 'parent' must be null or {{run_id, checkpoint}}, got {parent!r}")
            parent = ParentRef(parent["run_id"], parent["checkpoint"])
        samples = data["samples_by_policy_version"]
        if isinstance(samples, dict):
            samples = {_int_key(k): n for k, n in samples.items()}
        return cls(run_id=data["run_id"], checkpoint=data["checkpoint"], step=data["step"], parent=parent,
                   dataset_snapshot=data["dataset_snapshot"], config_hash=data["config_hash"],
                   code_version=data["code_version"], manifest_versions=data["manifest_versions"],
                   samples_by_policy_version=samples, created_at=data["created_at"],
                   extra=data.get("extra", {}))

    @classmethod
    def from_json(cls, text: str | bytes, source: str = "<string>") -> LineageRecord:
        """Parse and validate; every error message starts with ``source`` (the record's URL)."""
        try:
            return cls.from_dict(json.loads(text))
        except json.JSONDecodeError as e:
            raise LineageError(f"{source}: not valid JSON ({e})") from e
        except LineageError as e:
            raise LineageError(f"{source}: {e}") from e


def _check_name(what: str, value: Any) -> None:
    if not isinstance(value, str) or not _NAME.match(value):
        raise LineageError(f"field {what!r} must be a name of letters, digits, '.', '_' or '-' (it becomes "
                           f"part of a URL), got {value!r}")


def _check_count(what: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise LineageError(f"field {what!r} must be a non-negative integer, got {value!r}")


def _check_mapping(what: str, value: Any, key_type: type) -> None:
    if not isinstance(value, dict):
        raise LineageError(f"field {what!r} must be an object, got {type(value).__name__}")
    for k, n in value.items():
        if not isinstance(k, key_type) or isinstance(k, bool) or (key_type is int and k < 0):
            kind = "a policy version (integer >= 0)" if key_type is int else "a topic name"
            raise LineageError(f"field {what!r}: key {k!r} must be {kind}")
        _check_count(f"{what}[{k!r}]", n)


def _int_key(key: Any) -> Any:
    """JSON gives ``"3"``; anything that is not a plain decimal stays as it is and fails validation."""
    return int(key) if isinstance(key, str) and key.isdecimal() else key


def code_version() -> str:
    """``<relax version>+g<commit>[-dirty]`` inside a git checkout of Relax, else ``<relax version>``.

    Never raises: provenance must not stop training, so any git trouble means "no commit known".
    "-dirty" means tracked files differ from the commit (untracked files do not count).
    """
    try:
        version = metadata.version("relax")
    except metadata.PackageNotFoundError:
        version = "0+unknown"
    try:
        package = Path(__file__).resolve().parents[1]
        # A package installed into a venv that sits inside some git repo is not a checkout of Relax.
        if _git(package, "ls-files", "--error-unmatch", "__init__.py") is None:
            return version
        commit = _git(package, "rev-parse", "--short=12", "HEAD")
        status = _git(package, "status", "--porcelain", "--untracked-files=no")
    except Exception:  # see the docstring: never raise
        return version
    if not commit:
        return version
    return f"{version}+g{commit}" + ("-dirty" if status else "")


def _git(cwd: Path, *args: str) -> str | None:
    """stdout of a read-only git command, or None; never takes the index lock (another git may run)."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}
    try:
        out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10, env=env)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def record_url(root: str, run_id: str, checkpoint: str) -> str:
    """Where the record of ``run_id/checkpoint`` lives (it may not exist). A format warm-start is
    shared by every run that starts from it, so its record sits beside it, not under a run:
    ``<root>/warm_start/<key>/lineage.json``, named ``warm-start/<key>``."""
    _check_name("run_id", run_id)
    _check_name("checkpoint", checkpoint)
    if run_id == WARM_START_RUN:
        return objstore.join(objstore.absolute_url(root), "warm_start", checkpoint, "lineage.json")
    return objstore.join(objstore.absolute_url(root), "runs", run_id, "lineage", f"{checkpoint}.json")


#: What a record claims about its checkpoint; the rest (manifest versions, time) says when it was written.
PROVENANCE = ("run_id", "checkpoint", "step", "parent", "dataset_snapshot", "config_hash", "code_version",
              "samples_by_policy_version", "extra")


def write_record(root: str, record: LineageRecord, *, redo: bool = False) -> str:
    """Write ``record`` atomically and return its URL. Identical content already there is a no-op;
    a different record for the same checkpoint is refused (history is write-once). ``redo``: a
    checkpoint written again by a replay (after a corrupt or lost one) keeps the record already
    there when it claims the same provenance."""
    url = record_url(root, record.run_id, record.checkpoint)
    text = record.to_json()
    if objstore.exists(url):
        existing = LineageRecord.from_json(objstore.read_bytes(url), url)
        if existing.to_json() == text:
            return url
        if redo and all(getattr(existing, f) == getattr(record, f) for f in PROVENANCE):
            return url
        raise LineageError(f"a different lineage record for {record.key} already exists at {url}; records are "
                           f"write-once (use a new checkpoint name, or remove the old record by hand)")
    objstore.write_bytes(url, text.encode())
    return url


def read_record(root: str, run_id: str, checkpoint: str) -> LineageRecord:
    url = record_url(root, run_id, checkpoint)
    if not objstore.exists(url):
        raise LineageError(f"no lineage record for {run_id}/{checkpoint}: {url} does not exist")
    record = LineageRecord.from_json(objstore.read_bytes(url), url)
    if (record.run_id, record.checkpoint) != (run_id, checkpoint):
        raise LineageError(f"{url}: holds the record of {record.key}, not {run_id}/{checkpoint} "
                           f"(a file was copied or renamed by hand)")
    return record


def list_records(root: str, run_id: str) -> list[LineageRecord]:
    """Every record of one run, oldest step first; empty if the run has none."""
    folder = objstore.join(objstore.absolute_url(root), "runs", run_id, "lineage")
    names = [n[: -len(".json")] for n in objstore.list_dir(folder) if n.endswith(".json")]
    return sorted((read_record(root, run_id, n) for n in names), key=lambda r: (r.step, r.checkpoint))


def list_runs(root: str) -> list[str]:
    """Runs under ``root`` that have at least one lineage record, sorted by name."""
    runs = objstore.join(objstore.absolute_url(root), "runs")
    return [r for r in objstore.list_dir(runs)
            if any(n.endswith(".json") for n in objstore.list_dir(objstore.join(runs, r, "lineage")))]


def chain(root: str, run_id: str, checkpoint: str | None = None) -> list[LineageRecord]:
    """The given checkpoint (default: the run's latest) and its ancestors, newest first,
    following parents into earlier runs, down to a record without a parent."""
    if checkpoint is None:
        records = list_records(root, run_id)
        if not records:
            folder = objstore.join(objstore.absolute_url(root), "runs", run_id, "lineage")
            raise LineageError(f"run {run_id!r} has no lineage records (nothing under {folder})")
        current = records[-1]
    else:
        current = read_record(root, run_id, checkpoint)
    out = [current]
    seen = {current.key: 0}
    while current.parent is not None:
        parent = current.parent
        if str(parent) in seen:
            loop = " -> ".join(r.key for r in out[seen[str(parent)]:])
            raise LineageError(f"lineage cycle: {loop} -> {parent}; a parent must be an earlier checkpoint")
        url = record_url(root, parent.run_id, parent.checkpoint)
        if not objstore.exists(url):
            raise LineageError(f"{current.key} names parent {parent}, but its lineage record is missing: "
                               f"{url} does not exist")
        current = read_record(root, parent.run_id, parent.checkpoint)
        seen[current.key] = len(out)
        out.append(current)
    return out


def chain_to_json(records: list[LineageRecord]) -> dict[str, Any]:
    """A graph of the chain: dataset and checkpoint nodes (oldest first), "trained_on" edges
    (checkpoint -> dataset) and "parent" edges (checkpoint -> parent checkpoint)."""
    oldest_first = list(reversed(records))
    nodes: list[dict[str, Any]] = []
    edges: list[dict[str, str]] = []
    present = {r.key for r in records}
    for snapshot in dict.fromkeys(r.dataset_snapshot for r in oldest_first):
        nodes.append({"id": f"dataset:{snapshot}", "kind": "dataset", "snapshot": snapshot})
    for r in oldest_first:
        node_id = f"checkpoint:{r.key}"
        nodes.append({"id": node_id, "kind": "checkpoint", "sample_count": r.sample_count, **r.to_dict()})
        edges.append({"kind": "trained_on", "from": node_id, "to": f"dataset:{r.dataset_snapshot}"})
        if r.parent is not None and str(r.parent) in present:
            edges.append({"kind": "parent", "from": node_id, "to": f"checkpoint:{r.parent}"})
    head = records[0].key if records else None
    return {"head": head, "nodes": nodes, "edges": edges}


def policy_label(record: LineageRecord) -> str:
    """``v3-v7``, ``v3`` or ``-``: the policy versions whose samples this checkpoint trained on."""
    span = record.policy_range
    if span is None:
        return "-"
    return f"v{span[0]}" if span[0] == span[1] else f"v{span[0]}-v{span[1]}"


def chain_to_text(records: list[LineageRecord]) -> str:
    """One aligned line per checkpoint, newest first, with a parent arrow between lines."""
    if not records:
        return "(empty lineage chain)\n"
    runs = list(dict.fromkeys(r.run_id for r in records))
    datasets = list(dict.fromkeys(r.dataset_snapshot for r in records))
    rows = [[r.key, f"step {r.step}", f"samples {r.sample_count}", f"policy {policy_label(r)}",
             f"dataset {r.dataset_snapshot}", f"config {r.config_hash[:12]}", f"code {r.code_version}"]
            for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = [f"lineage of {records[0].key}: {_plural(len(records), 'checkpoint')}, {_plural(len(runs), 'run')}, "
             f"{_plural(len(datasets), 'dataset snapshot')} (newest first)"]
    for i, (record, row) in enumerate(zip(records, rows, strict=True)):
        lines.append("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
        lora = record.extra.get("lora") if isinstance(record.extra, dict) else None
        if isinstance(lora, dict):  # an adapter checkpoint: what it applies to is not in it
            lines.append(f"  LoRA adapter r={lora.get('rank')} on base model {lora.get('base_model')}, base checkpoint "
                         f"{lora.get('base_checkpoint') or '(none: the seeded model)'}")
        judge = record.extra.get("judge") if isinstance(record.extra, dict) else None
        if isinstance(judge, dict):  # a generative reward model graded its samples (relax.services.judge_record)
            source = judge.get("name_or_path") or judge.get("urls")
            lines.append(f"  rewards by judge {judge.get('model_id')} ({source}), "
                         f"template {judge.get('template_hash')}, verdict {judge.get('verdict')}")
        if record.parent is None:
            lines.append("  (format warm start of the base model)" if record.run_id == WARM_START_RUN
                         else "  (first checkpoint: no parent)")
        elif i + 1 < len(records):
            across = ("" if record.parent.run_id == record.run_id else " (from the format warm start)"
                      if record.parent.run_id == WARM_START_RUN else f" (from earlier run {record.parent.run_id})")
            lines.append(f"  v parent{across}")
    return "\n".join(lines) + "\n"


def _plural(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")
