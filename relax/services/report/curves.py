"""PNG training curves drawn with PIL (no matplotlib in the install): reward overall and per
task, actor loss, staleness; one panel each, x = rollout batch or actor step."""

from __future__ import annotations

import io
from typing import Any

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2")
W, H, PAD = 420, 260, 40


def _series(records: list[dict[str, Any]], x: str, keys: list[str]) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {}
    for k in keys:
        pts = [(float(r[x]), float(r[k])) for r in records if k in r and x in r]
        if pts:
            out[k] = pts
    return out


def _panel(draw: Any, ox: int, oy: int, title: str, series: dict[str, list[tuple[float, float]]]) -> None:
    draw.rectangle([ox, oy, ox + W - 1, oy + H - 1], outline="#888888")
    draw.text((ox + 8, oy + 6), title, fill="black")
    pts = [p for s in series.values() for p in s]
    if not pts:
        draw.text((ox + W // 3, oy + H // 2), "no data", fill="#888888")
        return
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(p[1] for p in pts), max(p[1] for p in pts)
    if y1 - y0 < 1e-9:
        y0, y1 = y0 - 0.5, y1 + 0.5
    x1 = x1 if x1 > x0 else x0 + 1

    def at(x: float, y: float) -> tuple[float, float]:
        return (ox + PAD + (x - x0) / (x1 - x0) * (W - 2 * PAD), oy + H - PAD - (y - y0) / (y1 - y0) * (H - 2 * PAD))

    draw.line([at(x0, y0), at(x1, y0)], fill="#444444")
    draw.line([at(x0, y0), at(x0, y1)], fill="#444444")
    draw.text((ox + 4, oy + PAD - 6), f"{y1:.3g}", fill="#444444")
    draw.text((ox + 4, oy + H - PAD - 6), f"{y0:.3g}", fill="#444444")
    draw.text((ox + W - PAD - 10, oy + H - PAD + 6), f"{x1:.0f}", fill="#444444")
    for i, (name, s) in enumerate(series.items()):
        colour = PALETTE[i % len(PALETTE)]
        if len(s) > 1:
            draw.line([at(*p) for p in s], fill=colour, width=2)
        else:
            cx, cy = at(*s[0])
            draw.ellipse([cx - 2, cy - 2, cx + 2, cy + 2], fill=colour)
        draw.text((ox + PAD + 8, oy + 22 + 12 * i), name, fill=colour)


def render_curves(by_role: dict[str, list[dict[str, Any]]]) -> bytes:
    from PIL import Image, ImageDraw

    rollout, actor = by_role.get("rollout", []), by_role.get("actor", [])
    # tasks only: the per-kind curves (reward/shapes:colour) would crowd the panel; they stay in metrics
    tasks = sorted({k for r in rollout for k in r if k.startswith("reward/") and ":" not in k})
    img = Image.new("RGB", (2 * W + 10, 2 * H + 10), "white")
    draw = ImageDraw.Draw(img)
    _panel(draw, 0, 0, "reward (rollout batch)", _series(rollout, "batch", ["reward"]))
    _panel(draw, W + 10, 0, "reward per task", _series(rollout, "batch", tasks))
    _panel(draw, 0, H + 10, "actor loss", _series(actor, "step", ["loss"]))
    _panel(draw, W + 10, H + 10, "staleness (max, mean)", _series(actor, "step", ["staleness_max", "staleness_mean"]))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
