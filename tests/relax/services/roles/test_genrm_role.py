"""The GenRM role: the reward role grading with a generative judge, in each topology.

The judge here answers yes to everything (tests/relax/services/judges.py), so a reward near 1 is
the judge's and not the verifier's (a fresh policy is right on a few rows of arithmetic at most).
Colocated: the judge's engine sits in the rollout's process (genrm.engines=0), its identity goes
into every checkpoint's lineage and `relax lineage`, and a restart with other judge weights is
refused. The disaggregated topology (a judge pool scaled through its REST API while the run
trains) is tests/relax/services/test_judge_engines.py's; the async topology's reward deployment
runs the judge in tests/relax/services/topologies/test_topologies.py."""

from __future__ import annotations

import shutil

import pytest

from relax.cli.main import main as relax_main
from relax.services.driver import train
from relax.services.judge_record import JudgeChanged, read_judge_record
from relax.transfer.lineage import list_records
from tests.relax.services.judges import nudged, yes_judge
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return yes_judge(str(tmp_path_factory.mktemp("judge") / "yes"))


def test_colocated_judge_grades_every_row_is_in_lineage_and_pinned(tmp_path, judge_dir, capsys):
    folder = str(tmp_path / "judge")
    shutil.copytree(judge_dir, folder)
    cfg = tiny_config(f"file://{tmp_path}/root", "judged", "data.reward_role=true", f"genrm.name_or_path={folder}",
                      "trainer.total_steps=2")
    result = train(cfg, progress=False)
    reward = result.metrics("reward")
    assert [m["step"] for m in reward] == [0, 1]
    assert all(m["reward"] > 0.9 and m["reward_errors"] == 0 for m in reward)  # the judge's, not the verifier's
    assert reward[-1]["genrm/judged_total"] == 2 * 16  # each row of each step judged once
    assert [m["reward"] for m in result.metrics("rollout")] == [m["reward"] for m in reward]
    judge = read_judge_record(result.run_url)["judge"]
    (record,) = [r for r in list_records(cfg.root, cfg.run_id) if r.step == 1]
    assert record.extra["judge"] == judge
    assert relax_main(["lineage", cfg.root, cfg.run_id]) == 0
    assert f"rewards by judge {judge['model_id']} ({folder})" in capsys.readouterr().out

    nudged(judge_dir, folder + "-b")  # the judge retrained in place, then the run resumed
    shutil.rmtree(folder)
    shutil.copytree(folder + "-b", folder)
    longer = tiny_config(cfg.root, "judged", "data.reward_role=true", f"genrm.name_or_path={folder}",
                         "trainer.total_steps=3")
    with pytest.raises(JudgeChanged, match="genrm.allow_change=true"):
        train(longer, progress=False)
    assert read_judge_record(result.run_url)["judge"] == judge
