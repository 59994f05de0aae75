"""Feed the configured trackers from a run's metrics logs and lineage records, never stopping it.

The roles append their metrics under ``<run>/metrics/`` whatever trackers are configured; the
feed reads what is new (:class:`relax.services.report.metrics.MetricsReader`) and sends each
role's steps past the tracker's cursor. A tracker's cursor (the last step it accepted, per role)
and its ids (the MLflow or W&B run a rerun continues) live in ``<run>/report/trackers/<name>.json``,
so a resumed run continues the same tracker run and sends no step twice.

A tracker that fails (server down, disk full) costs a warning: its cursor stays where it was, so
what it missed stays queued in the metrics logs and goes out at the next sync (every
``report.sync_every_s`` while the run trains, then at its end with retries), or later with
``relax report sync ROOT RUN``.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relax import objstore
from relax.config import config_hash, config_to_dict
from relax.services.report.metrics import ROLES, MetricsReader, merge_reward_role
from relax.services.run_context import RunContext
from relax.services.trackers.base import MetricRow, RunFacts, Tracker, metric_rows
from relax.transfer.lineage import LineageError, chain, code_version

log = logging.getLogger(__name__)


def run_facts(ctx: RunContext) -> RunFacts:
    cfg = ctx.cfg
    info = ctx.snapshot_info
    return RunFacts(run_id=cfg.run_id, run_url=ctx.run_url, root=ctx.root, config=config_to_dict(cfg),
                    config_hash=config_hash(cfg), code_version=code_version(), snapshot_id=info.id,
                    snapshot_url=info.url, model=cfg.model.name_or_path)


def build_trackers(ctx: RunContext) -> list[Tracker]:
    """The configured trackers that are fed (TensorBoard's event file is the report's: metrics.export_report)."""
    out: list[Tracker] = []
    for name in ctx.cfg.report.trackers:
        if name == "mlflow":
            from relax.services.trackers.mlflow_run import MlflowTracker

            out.append(MlflowTracker(ctx.cfg.report, ctx.root))
        elif name == "wandb":
            from relax.services.trackers.wandb_run import WandbTracker

            out.append(WandbTracker(ctx.cfg.report, ctx.run_url))
    return out


class TrackerFeed:
    """The trackers of one run and what each has accepted so far."""

    def __init__(self, ctx: RunContext, trackers: list[Tracker] | None = None):
        self.ctx, self.facts = ctx, run_facts(ctx)
        self.trackers = build_trackers(ctx) if trackers is None else trackers
        self.readers = {role: MetricsReader(ctx.run_url, role) for role in ROLES}
        self.records: dict[str, list[dict[str, Any]]] = {role: [] for role in ROLES}
        self.states: dict[str, dict[str, Any]] = {t.name: self._load(t.name) for t in self.trackers}
        self.opened: set[str] = set()
        self.failing: dict[str, str] = {}  # tracker -> its last error, while it fails
        self.lock = threading.Lock()

    def _state_url(self, name: str) -> str:
        return objstore.join(self.ctx.run_url, "report", "trackers", f"{name}.json")

    def _load(self, name: str) -> dict[str, Any]:
        url = self._state_url(name)
        state = json.loads(objstore.read_bytes(url)) if objstore.exists(url) else {}
        return {"ids": state.get("ids", {}), "cursor": state.get("cursor", {}), "logged": state.get("logged", [])}

    def _save(self, name: str) -> None:
        objstore.write_bytes(self._state_url(name), json.dumps(self.states[name], indent=1, sort_keys=True).encode())

    def _attempt(self, tracker: Tracker, what: str, fn: Callable[[], None], retries: int, backoff_s: float) -> bool:
        """Run ``fn`` (one tracker call, then saving its state) up to ``retries`` + 1 times; a
        failure is a warning, once per error while it lasts, never an exception."""
        for attempt in range(retries + 1):
            try:
                fn()
                if tracker.name in self.failing:
                    log.warning("tracker %s works again; it is caught up from the metrics logs", tracker.name)
                    del self.failing[tracker.name]
                return True
            except Exception as e:  # any tracker trouble; training goes on
                error = f"{type(e).__name__}: {e}"
                if attempt < retries:
                    time.sleep(backoff_s * 2 ** attempt)
        if self.failing.get(tracker.name) != error:
            log.warning("tracker %s failed to %s (%s). Training goes on; what it missed stays in %s/metrics "
                        "and is sent at the next sync, or by `relax report sync %s %s`", tracker.name, what,
                        error[:500], self.ctx.run_url, self.ctx.root, self.ctx.cfg.run_id)
        self.failing[tracker.name] = error
        return False

    def _open(self, tracker: Tracker) -> None:
        if tracker.name not in self.opened:
            state = self.states[tracker.name]
            state["ids"] = tracker.open(self.facts, state["ids"])
            self._save(tracker.name)
            self.opened.add(tracker.name)

    def _rows(self, final: bool) -> dict[str, list[MetricRow]]:
        for role, reader in self.readers.items():
            self.records[role].extend(reader.new())
        merge_reward_role(self.records)
        rows = {role: metric_rows(role, records) for role, records in self.records.items() if records}
        if not final and "rollout" in rows and self.ctx.cfg.data.reward_role:
            # a batch the reward role has not scored yet waits for its reward: each step is sent once
            batches = rows["rollout"]
            rows["rollout"] = batches[:next((i for i, r in enumerate(batches) if "rollout/reward" not in r.values),
                                            len(batches))]
        return rows

    def sync(self, final: bool = False, retries: int = 0, backoff_s: float = 0.5) -> bool:
        """Send every tracker the steps it has not accepted; True when all accepted them."""
        with self.lock:
            rows = self._rows(final)
            ok = True
            for tracker in self.trackers:
                ok &= self._attempt(tracker, "log metrics", lambda t=tracker: self._send(t, rows), retries, backoff_s)
            return ok

    def _send(self, tracker: Tracker, rows: dict[str, list[MetricRow]]) -> None:
        self._open(tracker)
        cursor = self.states[tracker.name]["cursor"]
        for role, role_rows in rows.items():
            new = [r for r in role_rows if r.step > cursor.get(role, -1)]
            if new:
                tracker.log_metrics(new)
                cursor[role] = new[-1].step
                self._save(tracker.name)

    def publish(self, retries: int = 0, backoff_s: float = 0.5) -> bool:
        """Record the run's newest checkpoint and its lineage in every tracker (once each)."""
        with self.lock:
            try:
                records = chain(self.ctx.root, self.ctx.cfg.run_id)
            except LineageError:
                return True  # no checkpoint yet: nothing to record
            ok = True
            for tracker in self.trackers:
                ok &= self._attempt(tracker, "record the checkpoint",
                                    lambda t=tracker: self._log_checkpoint(t, records), retries, backoff_s)
            return ok

    def _log_checkpoint(self, tracker: Tracker, records: list) -> None:
        logged = self.states[tracker.name]["logged"]
        if records[0].key in logged:
            return
        self._open(tracker)
        tracker.log_checkpoint(records[0], records)
        logged.append(records[0].key)
        self._save(tracker.name)

    def close(self) -> None:
        with self.lock:
            for tracker in self.trackers:
                if tracker.name in self.opened:
                    self._attempt(tracker, "close its run", tracker.close, 0, 0.0)
            self.opened.clear()


class LiveFeed:
    """Syncs a feed every ``every_s`` in a daemon thread while a run trains."""

    def __init__(self, feed: TrackerFeed, every_s: float):
        self.feed, self.every_s = feed, every_s
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._loop, name="relax-trackers", daemon=True)
        if every_s > 0:
            self.thread.start()

    def _loop(self) -> None:
        while not self.stopped.wait(self.every_s):
            self.feed.sync()

    def stop(self) -> None:
        self.stopped.set()
        if self.thread.is_alive():
            self.thread.join()


def start_feed(ctx: RunContext) -> LiveFeed | None:
    """The live feed of a starting run; None when no tracker is fed (only TensorBoard or none)."""
    trackers = build_trackers(ctx)
    return LiveFeed(TrackerFeed(ctx, trackers), ctx.cfg.report.sync_every_s) if trackers else None


def sync_run(ctx: RunContext, live: LiveFeed | None = None) -> bool:
    """At a run's end (or any time after, ``relax report sync``): every step and the newest checkpoint
    sent to every tracker, with retries; True when all of them accepted everything."""
    if live is not None:
        live.stop()
        feed = live.feed
    else:
        trackers = build_trackers(ctx)
        if not trackers:
            return True
        feed = TrackerFeed(ctx, trackers)
    ok = feed.sync(final=True, retries=2) & feed.publish(retries=2)
    feed.close()
    return ok
