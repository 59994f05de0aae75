"""The report's PNG: every panel a run is read by, from its metrics records and evaluations.

Eight panels, two per row, x in steps (rollout batch or actor step) with wall time along the top:
reward (raw faint, EMA bold), reward per task, held-out accuracy at each evaluation, actor loss
on a symmetric-log scale, staleness, throughput in samples/s, in tokens/s, and time per step by
role. Drawing is ``relax.services.report.plot``'s.
"""

from __future__ import annotations

import io
from typing import Any

from relax.services.report.plot import H, Panel, Series, W, draw_panel

COLUMNS = 2
TIMED_ROLES = ("rollout", "reward", "advantage", "reference", "critic", "teacher", "actor")


def _pts(records: list[dict[str, Any]], x: str, key: str) -> list[tuple[float, float]]:
    return [(float(r[x]), float(r[key])) for r in records if key in r and x in r and r[key] is not None]


def _rate(records: list[dict[str, Any]], x: str, amount: str) -> list[tuple[float, float]]:
    """``amount`` per second of the step's own time (``time_s``)."""
    return [(float(r[x]), float(r[amount]) / r["time_s"]) for r in records
            if amount in r and x in r and r.get("time_s", 0) > 0]


def _wall(records: list[dict[str, Any]], x: str, t0: float) -> list[tuple[float, float]]:
    return [(float(r[x]), r["time"] - t0) for r in records if x in r and "time" in r]


def accuracy_points(accuracy: dict[str, Any] | None, last_step: int) -> list[Series]:
    """Held-out accuracy per modality at each evaluation: before RL at step 0, after it at the last step."""
    if not accuracy:
        return []
    return [Series(m, [(0.0, v["before"]), (float(last_step), v["after"])], smooth=False, markers=True)
            for m, v in sorted(accuracy.get("modalities", {}).items())]


def panels(by_role: dict[str, list[dict[str, Any]]], accuracy: dict[str, Any] | None = None) -> list[Panel]:
    """The report's panels from :func:`relax.services.report.metrics.read_all_metrics`'s records and
    ``accuracy.json`` (``relax.services.report.accuracy``; None before the run is evaluated)."""
    rollout, actor = by_role.get("rollout", []), by_role.get("actor", [])
    times = [r["time"] for rs in by_role.values() for r in rs if "time" in r]
    t0 = min(times) if times else 0.0
    wall_r, wall_a = _wall(rollout, "batch", t0), _wall(actor, "step", t0)
    # tasks only: the per-kind curves (reward/shapes:colour) would crowd the panel; they stay in metrics
    tasks = sorted({k for r in rollout for k in r if k.startswith("reward/") and ":" not in k})
    last = max((int(r["step"]) for r in actor), default=0)
    timed = [Series(role, _pts(by_role.get(role, []), "batch" if role == "rollout" else "step", "time_s"))
             for role in TIMED_ROLES]
    return [
        Panel("Training reward (raw faint, EMA bold)", "mean reward",
              [Series("reward", _pts(rollout, "batch", "reward"))], x_label="rollout batch", wall=wall_r),
        Panel("Reward per task", "mean reward", [Series(t[len("reward/"):], _pts(rollout, "batch", t)) for t in tasks],
              x_label="rollout batch", wall=wall_r),
        Panel("Held-out accuracy at each evaluation", "accuracy", accuracy_points(accuracy, last), wall=wall_a),
        Panel("Actor loss", "loss", [Series("loss", _pts(actor, "step", "loss"))], symlog=True, wall=wall_a),
        Panel("Staleness of trained samples", "policy versions",
              [Series("max", _pts(actor, "step", "staleness_max")),
               Series("mean", _pts(actor, "step", "staleness_mean"))], wall=wall_a),
        Panel("Throughput", "samples/s", [Series("rollout", _pts(rollout, "batch", "samples_per_s")),
                                          Series("actor", _rate(actor, "step", "samples"))], wall=wall_a),
        Panel("Training throughput", "tokens/s", [Series("actor", _rate(actor, "step", "tokens"))], wall=wall_a),
        Panel("Time per step by role", "seconds", [s for s in timed if s.points], wall=wall_a),
    ]


def render_curves(by_role: dict[str, list[dict[str, Any]]], accuracy: dict[str, Any] | None = None) -> bytes:
    """The panels as one PNG."""
    from PIL import Image, ImageDraw

    shown = panels(by_role, accuracy)
    rows = (len(shown) + COLUMNS - 1) // COLUMNS
    img = Image.new("RGB", (COLUMNS * W + (COLUMNS - 1) * 10, rows * H + (rows - 1) * 10), "white")
    draw = ImageDraw.Draw(img)
    for i, panel in enumerate(shown):
        draw_panel(draw, (i % COLUMNS) * (W + 10), (i // COLUMNS) * (H + 10), panel)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
