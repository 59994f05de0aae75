"""One chart panel drawn with PIL (matplotlib is not in the install): titled axes with ticks,
raw series faint under their EMA in bold, an optional symmetric-log y scale, and wall time as a
second x axis along the top.

A panel is a :class:`Panel` of :class:`Series`; :func:`draw_panel` draws it into a PIL image at
a given box. Pure drawing: which panels a report has is ``relax.services.report.curves``'s job.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf")
W, H = 560, 300  # one panel
LEFT, RIGHT, TOP, BOTTOM = 62, 14, 44, 40  # plot area margins inside a panel: tick labels and titles
AXIS, GRID, TEXT = "#444444", "#e6e6e6", "#222222"


@dataclass
class Series:
    """``points``: (x, y) pairs, x ascending. ``smooth``: draw the raw points faint and their EMA bold;
    ``markers``: dots at each point (few points, e.g. evaluations)."""

    name: str
    points: list[tuple[float, float]]
    smooth: bool = True
    markers: bool = False


@dataclass
class Panel:
    title: str
    y_label: str
    series: list[Series] = field(default_factory=list)
    x_label: str = "step"
    symlog: bool = False
    wall: list[tuple[float, float]] = field(default_factory=list)  # (step, seconds since the run began)


def ema(values: list[float], span: int | None = None) -> list[float]:
    """Exponential moving average, bias-corrected so the first values are not pulled towards 0;
    ``span`` defaults to a tenth of the series (at least 2)."""
    span = span or max(2, len(values) // 10)
    alpha, avg, weight, out = 2 / (span + 1), 0.0, 0.0, []
    for v in values:
        avg = (1 - alpha) * avg + alpha * v
        weight = (1 - alpha) * weight + alpha
        out.append(avg / weight)
    return out


def symlog(y: float, lin: float) -> float:
    """Linear within ``lin`` of 0, logarithmic beyond: one spike no longer flattens the rest."""
    return math.copysign(math.log10(1 + abs(y) / lin), y)


def symexp(t: float, lin: float) -> float:
    return math.copysign((10 ** abs(t) - 1) * lin, t)


def nice_ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(1, n - 1)
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.ceil(lo / step - 1e-9) * step
    return [first + i * step for i in range(int((hi - first) / step + 1e-9) + 1)]


def fmt(v: float) -> str:
    if abs(v) >= 1e6:
        return f"{v / 1e6:.3g}M"
    if abs(v) >= 1e3:
        return f"{v / 1e3:.3g}k"
    if v != 0 and abs(v) < 1e-2:
        return f"{v:.0e}"
    return f"{v:.3g}"


def wall_text(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}" if s < 3600 else f"{s // 3600}h{s % 3600 // 60:02d}"


def _faint(colour: str) -> str:
    r, g, b = (int(colour[i:i + 2], 16) for i in (1, 3, 5))
    return "#" + "".join(f"{int(c + (255 - c) * 0.7):02x}" for c in (r, g, b))


def draw_panel(draw: Any, ox: int, oy: int, panel: Panel) -> None:
    """Draw ``panel`` with its top-left corner at (ox, oy)."""
    draw.rectangle([ox, oy, ox + W - 1, oy + H - 1], outline="#bbbbbb")
    draw.text((ox + 8, oy + 4), panel.title, fill=TEXT)
    x0p, x1p, y0p, y1p = ox + LEFT, ox + W - RIGHT, oy + H - BOTTOM, oy + TOP
    series = [s for s in panel.series if s.points]
    if not series:
        draw.text((ox + W // 2 - 30, oy + H // 2), "no data yet", fill="#888888")
        return
    lin = _linthresh(series) if panel.symlog else 1.0
    ty = (lambda y: symlog(y, lin)) if panel.symlog else (lambda y: y)
    xs = [p[0] for s in series for p in s.points]
    ys = [ty(p[1]) for s in series for p in s.points]
    xlo, xhi = min(xs), max(xs)
    ylo, yhi = min(ys), max(ys)
    if xhi - xlo < 1e-9:
        xlo, xhi = xlo - 0.5, xhi + 0.5
    if yhi - ylo < 1e-12:
        ylo, yhi = ylo - 0.5, yhi + 0.5
    span = yhi - ylo  # room above the data for the legend
    ylo, yhi = ylo - span * 0.05, yhi + span * (0.08 + 0.07 * ((len(series) - 1) // 3 + 1))

    def at(x: float, t: float) -> tuple[float, float]:
        return x0p + (x - xlo) / (xhi - xlo) * (x1p - x0p), y0p - (t - ylo) / (yhi - ylo) * (y0p - y1p)

    yticks = _symlog_ticks(ylo, yhi, lin) if panel.symlog else nice_ticks(ylo, yhi)
    for t in yticks:
        if ylo <= t <= yhi:
            _, py = at(xlo, t)
            draw.line([(x0p, py), (x1p, py)], fill=GRID)
            label = fmt(symexp(t, lin) if panel.symlog else t)
            draw.text((ox + 4, py - 5), label, fill=AXIS)
    for x in nice_ticks(xlo, xhi, 6):
        px, _ = at(x, ylo)
        draw.line([(px, y0p), (px, y0p + 4)], fill=AXIS)
        draw.text((px - 6, y0p + 6), f"{x:.0f}", fill=AXIS)
    draw.line([(x0p, y0p), (x1p, y0p)], fill=AXIS)
    draw.line([(x0p, y0p), (x0p, y1p)], fill=AXIS)
    draw.text((x1p - 8 * len(panel.x_label) - 4, y0p + 20), panel.x_label, fill=TEXT)
    draw.text((ox + 4, y1p - 16), panel.y_label + (" (symlog)" if panel.symlog else ""), fill=TEXT)
    _wall_axis(draw, panel, at, xlo, xhi, ylo, y1p)
    for i, s in enumerate(series):  # every raw line first, so no faint line crosses a bold one
        if s.smooth and len(s.points) > 2:
            draw.line([at(x, ty(y)) for x, y in s.points], fill=_faint(PALETTE[i % len(PALETTE)]), width=1)
    for i, s in enumerate(series):
        colour = PALETTE[i % len(PALETTE)]
        pts = [at(x, ty(y)) for x, y in s.points]
        if s.smooth and len(pts) > 2:
            smooth = ema([y for _, y in s.points])
            draw.line([at(x, ty(y)) for (x, _), y in zip(s.points, smooth, strict=True)], fill=colour, width=3)
        elif len(pts) > 1:
            draw.line(pts, fill=colour, width=2)
        if s.markers or len(pts) == 1:
            for cx, cy in pts:
                draw.ellipse([cx - 3, cy - 3, cx + 3, cy + 3], fill=colour)
        draw.text((x0p + 8 + 150 * (i % 3), y1p + 2 + 12 * (i // 3)), s.name, fill=colour)


def _linthresh(series: list[Series]) -> float:
    """The linear band of a symlog axis: a tenth of the median magnitude, so typical values sit in the log part."""
    mags = sorted(abs(y) for s in series for _, y in s.points if y != 0)
    return max(mags[len(mags) // 2] / 10, 1e-12) if mags else 1.0


def _symlog_ticks(lo: float, hi: float, lin: float) -> list[float]:
    """Ticks at 0 and at powers of ten (with their sign) inside [lo, hi] of the symlog axis."""
    out = [0.0]
    for e in range(-12, 13):
        for sign in (1, -1):
            t = symlog(sign * 10.0 ** e, lin)
            if lo <= t <= hi and abs(t) > 0.3:
                out.append(t)
    out.sort()
    while len(out) > 7:  # too crowded: every other one
        out = out[::2]
    return out


def _wall_axis(draw: Any, panel: Panel, at: Any, xlo: float, xhi: float, ylo: float, y1p: float) -> None:
    """Wall time since the run began, along the top, at the steps where it was measured."""
    wall = [(x, w) for x, w in panel.wall if xlo <= x <= xhi]
    if len(wall) < 2:
        return
    for x in nice_ticks(xlo, xhi, 5):
        nearest = min(wall, key=lambda p: abs(p[0] - x))
        px, _ = at(nearest[0], ylo)
        draw.line([(px, y1p), (px, y1p - 3)], fill=AXIS)
        draw.text((px - 8, y1p - 28), wall_text(nearest[1]), fill="#777777")
    draw.text((at(xhi, ylo)[0] - 60, y1p - 40), "wall time", fill="#777777")
