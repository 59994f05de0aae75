"""The nightly launch plan, called through the Python API (a local call forwards inputs; nothing is
scheduled): two ticks on one root make two runs, the second continuing from the first's checkpoint."""

from __future__ import annotations

from datetime import datetime

import pytest

from relax.config import load_config
from tasks.retrain import retrain_run_id
from tests.workflows.test_omni_rl import TASKS, TINY


def test_run_id_per_tick():
    assert retrain_run_id("nightly", datetime(2026, 3, 9, 3, 0)) == "nightly-20260309-0300"


@pytest.mark.ray
def test_second_tick_continues_the_lineage_of_the_first(tmp_path, ray_session):
    from workflows.nightly import omni_rl_nightly

    cfg = load_config(None, [f"root=file://{tmp_path}/root", "run_id=nightly", *TINY])
    first = omni_rl_nightly(cfg=cfg, kickoff_time=datetime(2026, 1, 1, 3, 0))
    assert first.train.run_id == "nightly-20260101-0300"
    assert first.eval_before.checkpoint.startswith(f"file://{tmp_path}/root/warm_start/")  # nothing earlier
    assert [s.parent for s in first.lineage.steps][-1] == ""

    second = omni_rl_nightly(cfg=cfg, kickoff_time=datetime(2026, 1, 2, 3, 0))
    assert second.train.run_id == "nightly-20260102-0300"
    # RL started from the first run's final checkpoint (no second warm-start), and "before" scored it
    assert second.eval_before.checkpoint == first.train.checkpoint
    assert set(second.eval_after.accuracy) == TASKS
    runs = [s.run_id for s in second.lineage.steps]  # newest first, ending at the first run's warm start
    assert runs[0] == second.train.run_id and runs[-2] == first.train.run_id and runs[-1] == "warm-start"
    assert runs[:-1] == sorted(runs[:-1], reverse=True)  # one run, then the earlier one: no interleaving
    oldest_of_second = [s for s in second.lineage.steps if s.run_id == second.train.run_id][-1]
    assert oldest_of_second.parent == first.lineage.head  # the link across runs
    assert second.lineage.steps[len(runs) - len(first.lineage.steps):] == first.lineage.steps
    assert f"from earlier run {first.train.run_id}" in second.lineage.chain_text
    assert second.snapshot.id == first.snapshot.id  # unchanged data: the same (newest) snapshot
