"""The GenRM role: the reward role grading with a generative judge, in each topology.

The judge here answers yes to everything (tests/relax/services/judges.py), so a reward near 1 is
the judge's and not the verifier's (a fresh policy is right on a few rows of arithmetic at most).
Colocated: the judge's engine sits in the rollout's process (genrm.engines=0), its identity goes
into every checkpoint's lineage and `relax lineage`, and a restart with other judge weights is
refused. Disaggregated: the reward role owns a judge engine process and serves the judge pool's
elastic REST API, scaled out and back in while the run trains. The async topology's reward
deployment runs the judge in tests/relax/services/topologies/test_topologies.py."""

from __future__ import annotations

import json
import shutil
import threading
import urllib.request

import pytest

from relax.cli.main import main as relax_main
from relax.services.driver import train
from relax.services.judge_record import JudgeChanged, read_judge_record
from relax.services.report.metrics import read_metrics
from relax.transfer.lineage import list_records
from tests.polling import wait_until
from tests.relax.services.judges import nudged, yes_judge
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow
STEPS = 30


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


def _post(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_disaggregated_judge_pool_scales_out_and_in_through_the_rest_api(tmp_path, judge_dir, monkeypatch):
    from tests.conftest import _free_port

    token, port = "judge-api-token", _free_port()
    monkeypatch.setenv("RELAX_API_TOKEN", token)
    # an untrained judge writing 160 greedy tokens a row (invalid verdicts, scored 0): a step takes seconds, so
    # the run is still going when the scale operations (an engine start, a drain) return
    cfg = tiny_config(f"file://{tmp_path}", "scaled", "topology=disaggregated", "data.reward_role=true",
                      "genrm.name_or_path=tiny-qwen2", "genrm.verdict=score", "genrm.max_new_tokens=160",
                      "genrm.invalid=zero", "genrm.engines=1", "genrm.max_engines=2", f"genrm.api_port={port}",
                      f"trainer.total_steps={STEPS}", "trainer.checkpoint_every=10")
    done: list = []
    runner = threading.Thread(target=lambda: done.append(train(cfg, progress=False)))
    runner.start()
    try:
        api = f"http://127.0.0.1:{port}"
        run_url = f"{cfg.root}/runs/{cfg.run_id}"

        def engines_seen(n: int) -> bool:
            return any(m.get("genrm/engines") == n for m in read_metrics(run_url, "reward")[-3:])

        wait_until(lambda: engines_seen(1), timeout=300)
        out = _post(f"{api}/rollout/scale_out", {"num_replicas": 1}, token)
        assert out["status"] == "succeeded" and len(out["engines_added"]) == 1
        wait_until(lambda: engines_seen(2), timeout=120)
        out = _post(f"{api}/rollout/scale_in", {"num_replicas": 1}, token)
        assert out["status"] == "succeeded" and len(out["engines_removed"]) == 1
        wait_until(lambda: engines_seen(1) and read_metrics(run_url, "reward")[-1]["genrm/engines"] == 1,
                   timeout=120)
    finally:
        runner.join(timeout=600)
    (result,) = done
    assert result.steps == STEPS
    reward = result.metrics("reward")
    assert [m["step"] for m in reward] == list(range(STEPS))  # each step scored once, scaled or not
    assert reward[-1]["genrm/judged_total"] == STEPS * 16 == reward[-1]["genrm/unparsable_total"]
    assert [m["genrm/engines"] for m in reward][-1] == 1 and 2 in [m["genrm/engines"] for m in reward]
