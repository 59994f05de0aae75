"""The report's panels: what each plots from the records, EMA and symlog, and the HTML page."""

from __future__ import annotations

import base64
import math
import re

import pytest

from relax.services.report.curves import panels
from relax.services.report.page import report_html
from relax.services.report.plot import ema, nice_ticks, symexp, symlog

T0 = 1_700_000_000.0


def _records(n: int = 20):
    rollout = [{"batch": i, "time": T0 + 2 * i, "reward": (i % 2) * 1.0, "reward/arithmetic": 0.5,
                "reward/shapes": 0.25, "reward/shapes:colour": 1.0, "samples_per_s": 40.0, "time_s": 0.5}
               for i in range(n)]
    actor = [{"step": i, "time": T0 + 2 * i + 1, "loss": 100.0 if i == 3 else 0.01 * i, "staleness_max": 1,
              "staleness_mean": 0.5, "samples": 16, "tokens": 640, "time_s": 0.25} for i in range(n)]
    advantage = [{"step": i, "time": T0 + 2 * i, "time_s": 0.125} for i in range(n)]
    return {"rollout": rollout, "actor": actor, "advantage": advantage}


def test_each_panel_plots_what_its_title_says():
    accuracy = {"modalities": {"text": {"before": 0.1, "after": 0.6}, "image": {"before": 0.0, "after": 0.3}}}
    shown = {p.title: p for p in panels(_records(), accuracy)}
    assert len(shown) == 8
    reward = shown["Training reward (raw faint, EMA bold)"]
    assert reward.series[0].smooth and reward.series[0].points[:2] == [(0.0, 0.0), (1.0, 1.0)]
    assert reward.wall[:2] == [(0.0, 0.0), (1.0, 2.0)]  # seconds since the run's first record, per batch
    assert [s.name for s in shown["Reward per task"].series] == ["arithmetic", "shapes"]  # kinds stay out
    held_out = shown["Held-out accuracy at each evaluation"].series
    assert [(s.name, s.points) for s in held_out] == [("image", [(0.0, 0.0), (19.0, 0.3)]),
                                                      ("text", [(0.0, 0.1), (19.0, 0.6)])]
    assert shown["Actor loss"].symlog and not reward.symlog
    (tokens,) = shown["Training throughput"].series
    assert tokens.points[0] == (0.0, 640 / 0.25)
    assert {s.name: s.points[0][1] for s in shown["Throughput"].series} == {"rollout": 40.0, "actor": 64.0}
    assert {s.name: s.points[0][1] for s in shown["Time per step by role"].series} == {
        "rollout": 0.5, "advantage": 0.125, "actor": 0.25}
    assert shown["Held-out accuracy at each evaluation"].series and not panels(_records())[2].series


def test_ema_is_bias_corrected_and_follows_a_step():
    assert ema([1.0, 1.0, 1.0]) == pytest.approx([1.0, 1.0, 1.0])  # no pull towards 0 at the start
    smooth = ema([0.0] * 10 + [1.0] * 10, span=3)
    assert smooth[9] == 0.0 and 0.4 < smooth[10] < 0.6 and smooth[-1] > 0.99


def test_symlog_is_linear_near_zero_and_logarithmic_beyond():
    assert symlog(0.0, 1.0) == 0.0 and symlog(-5.0, 1.0) == -symlog(5.0, 1.0)
    assert symlog(1000.0, 1.0) - symlog(100.0, 1.0) == pytest.approx(1.0, abs=0.01)
    for y in (-3e4, -0.2, 0.0, 1e-3, 7.5):
        assert symexp(symlog(y, 0.01), 0.01) == pytest.approx(y)
    assert nice_ticks(0, 1) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0])
    assert all(math.isclose(t, round(t)) for t in nice_ticks(0, 39, 6))


def test_the_html_page_embeds_the_png_and_escapes_names():
    page = report_html("r<1>", b"\x89PNG-bytes", _records(), {"tasks": {"arithmetic": {"before": 0.1, "after": 0.6}}})
    embedded = re.search(r'src="data:image/png;base64,([A-Za-z0-9+/=]+)"', page)
    assert embedded and base64.b64decode(embedded.group(1)) == b"\x89PNG-bytes"
    assert "r&lt;1&gt;" in page and "r<1>" not in page
    assert re.search(r"<td>arithmetic</td><td>0\.100</td><td>0\.600</td>", page)
    assert "<td>loss 0.19</td>" in page and "<td>records 20</td>" in page  # the actor's last step
