"""The report as one self-contained HTML page: the curves, the last value of each role's key
figures, and the held-out accuracy table; what ``relax report`` writes and the Flyte Deck shows."""

from __future__ import annotations

import base64
import html
from typing import Any

# what a reader looks for first in each role's last record
KEY_FIGURES = {"rollout": ("batch", "reward", "samples_per_s", "response_tokens", "time_s"),
               "actor": ("step", "loss", "staleness_max", "grad_norm", "approx_kl", "samples", "tokens", "time_s"),
               "critic": ("step", "value_loss", "time_s")}


def _cell(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else html.escape(str(v))


def report_html(run_id: str, png: bytes, by_role: dict[str, list[dict[str, Any]]],
                accuracy: dict[str, Any] | None = None) -> str:
    """The page for ``run_id``: ``png`` inline, then the tables (names escaped: run ids are user text)."""
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>Relax run {html.escape(run_id)}</title>"
             "<style>body{font-family:sans-serif;margin:24px}td,th{padding:2px 10px;text-align:right}"
             "th{background:#eee}</style></head><body>",
             f"<h2>Relax run {html.escape(run_id)}</h2>",
             '<img alt="training curves" src="data:image/png;base64,' + base64.b64encode(png).decode() + '"/>']
    rows = []
    for role, keys in KEY_FIGURES.items():
        records = by_role.get(role, [])
        if records:
            last = records[-1]
            rows.append(f"<tr><th>{role}</th>" + "".join(f"<td>{k} {_cell(last[k])}</td>" for k in keys if k in last)
                        + f"<td>records {len(records)}</td></tr>")
    if rows:
        parts.append("<h3>Last step of each role</h3><table>" + "".join(rows) + "</table>")
    if accuracy:
        table = "".join(f"<tr><td>{html.escape(t)}</td><td>{v['before']:.3f}</td><td>{v['after']:.3f}</td></tr>"
                        for t, v in sorted(accuracy.get("tasks", {}).items()))
        parts.append("<h3>Held-out accuracy</h3><table><tr><th>task</th><th>before RL</th><th>after RL</th></tr>"
                     f"{table}</table>")
    parts.append("<p>Every record: <code>metrics.jsonl</code>; TensorBoard: <code>events.out.tfevents.relax</code> "
                 "(beside this page).</p></body></html>")
    return "\n".join(parts)
