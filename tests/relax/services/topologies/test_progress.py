"""Progress while a run trains: compact lines in a log (stderr not a terminal), at least every tenth."""

from __future__ import annotations

import io
import re

from relax.services.topologies.progress import Progress, eta_text


def _lines(total: int, steps: list[int], start: int = 0, enabled: bool = True) -> list[str]:
    out = io.StringIO()  # isatty() is False: what a log file or CI gives
    p = Progress(total, start, enabled, stream=out)
    p.rollout({"reward": 0.25})
    for s in steps:
        p.actor({"step": s, "samples": 8})
    p.close()
    return out.getvalue().splitlines()


def test_a_log_gets_a_line_each_tenth_and_at_the_last_step():
    lines = _lines(15, list(range(15)))
    assert [int(re.match(r"step (\d+)/15  ", ln).group(1)) for ln in lines] == [2, 4, 6, 8, 10, 12, 14, 15]
    assert re.fullmatch(r"step 15/15  reward 0\.250  samples/s [0-9.]+  ETA 0s", lines[-1])
    assert "\r" not in "".join(lines)  # no bar redraws in a log


def test_a_redone_step_prints_nothing_twice_and_a_resume_counts_from_its_start():
    assert [ln.split()[1] for ln in _lines(4, [0, 1, 1, 1, 2, 3])] == ["1/4", "2/4", "3/4", "4/4"]
    assert [ln.split()[1] for ln in _lines(20, [10, 11, 12, 19], start=10)] == ["12/20", "20/20"]


def test_no_progress_prints_nothing():
    assert _lines(10, list(range(10)), enabled=False) == []


def test_eta_reads_in_the_unit_that_matters():
    assert [eta_text(s) for s in (0.4, 42, 185, 7620, float("nan"))] == ["0s", "42s", "3m05s", "2h07m", "?"]


def test_a_reward_not_yet_read_prints_as_a_question_mark_not_nan():
    out = io.StringIO()
    p = Progress(2, 0, True, stream=out)
    p.actor({"step": 0, "samples": 8})
    p.rollout({"reward": 0.5})
    p.actor({"step": 1, "samples": 8})
    assert [ln.split()[3] for ln in out.getvalue().splitlines()] == ["?", "0.500"]
