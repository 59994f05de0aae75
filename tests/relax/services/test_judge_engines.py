"""The reward role's judge (relax.services.judge_engines, judge_record): its record in the run, and
its owned engines healing under a batch.

A run is graded by one judge: the first start records it (weights' content hash, template hash,
verdict), a restart with other weights is refused unless genrm.allow_change, which records the
change. A judge engine SIGKILLed while it holds a batch is replaced and the batch is judged whole,
with the verdicts an unbroken engine gives. A disaggregated run's judge pool is scaled out and back in
through its REST API while the run trains."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import urllib.request

import pytest

from relax import objstore
from relax.services.driver import train
from relax.services.judge_engines import open_judge
from relax.services.judge_record import RECORD, JudgeChanged, judge_lineage, read_judge_record
from relax.services.report.metrics import read_metrics
from relax.services.run_context import RunContext
from tests.polling import wait_until
from tests.relax.services.judges import nudged, yes_judge
from tests.relax.services.runtime_helpers import tiny_config


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory):
    return yes_judge(str(tmp_path_factory.mktemp("judge") / "yes"))


def _ctx(root: str, *overrides: str) -> RunContext:
    return RunContext(tiny_config(f"file://{root}", "judged", "data.reward_role=true", *overrides))


def test_a_restart_with_another_judge_is_refused_unless_allowed(tmp_path, judge_dir):
    folder = str(tmp_path / "judge")
    shutil.copytree(judge_dir, folder)
    nudged(judge_dir, folder + "-b")
    ctx = _ctx(str(tmp_path / "root"), f"genrm.name_or_path={folder}")
    open_judge(ctx).close()
    first = read_judge_record(ctx.run_url)
    assert first["changes"] == [] and len(first["judge"]["model_id"]) == 16
    assert first["judge"]["name_or_path"] == folder and first["judge"]["verdict"] == "yes_no"
    open_judge(ctx).close()  # the same judge again: fine, nothing recorded
    assert read_judge_record(ctx.run_url) == first
    shutil.rmtree(folder)
    shutil.copytree(folder + "-b", folder)  # someone retrained the judge in place
    with pytest.raises(JudgeChanged, match="genrm.allow_change=true") as e:
        open_judge(ctx)
    assert "model_id" in str(e.value) and first["judge"]["model_id"] in str(e.value)
    allowed = _ctx(str(tmp_path / "root"), f"genrm.name_or_path={folder}", "genrm.allow_change=true")
    open_judge(allowed).close()
    record = read_judge_record(ctx.run_url)
    assert len(record["changes"]) == 1 and record["changes"][0]["from"] == first["judge"]
    assert record["judge"]["model_id"] != first["judge"]["model_id"]
    assert judge_lineage(ctx.run_url) == {"judge": record["judge"], "judge_changes": 1}


def test_a_malformed_judge_record_is_not_trusted(tmp_path, judge_dir):
    ctx = _ctx(str(tmp_path), f"genrm.name_or_path={judge_dir}")
    objstore.write_bytes(objstore.join(ctx.run_url, RECORD), json.dumps({"judge": "me"}).encode())
    with pytest.raises(ValueError, match="is not a judge record"):
        open_judge(ctx)


@pytest.mark.slow
def test_a_judge_engine_killed_mid_batch_is_replaced_and_every_row_judged_once(tmp_path):
    # an untrained judge asked for <score>: 48 greedy tokens per row, long enough to kill it mid-batch
    ctx = _ctx(str(tmp_path), "genrm.name_or_path=tiny-qwen2", "genrm.engines=1", "genrm.max_engines=2",
               "genrm.verdict=score", "genrm.max_new_tokens=48", "genrm.invalid=zero")
    judge = open_judge(ctx)
    try:
        samples = ctx.split("train")[:24]
        pairs = [(f"<answer>{i}</answer>", s) for i, s in enumerate(samples)]
        ids = [f"row-{i}" for i in range(len(pairs))]
        baseline = judge.verdicts(pairs, ids)
        (engine,) = judge.pool.owned.values()
        out: list = []
        worker = threading.Thread(target=lambda: out.append(judge.verdicts(pairs, ids)))
        worker.start()
        wait_until(lambda: any(e["outstanding"] for e in judge.pool.engines()), timeout=60)
        os.kill(engine.proc.pid, signal.SIGKILL)
        worker.join(timeout=300)
        assert not worker.is_alive() and len(out) == 1
        assert out[0] == baseline  # one verdict per row, the ones an unbroken engine gives
        assert judge.pool.fault_counts()["engines_replaced"] >= 1
        assert engine.proc.poll() is not None and len(judge.pool.owned) == 1
    finally:
        judge.close()


@pytest.mark.slow
def test_a_judge_behind_urls_and_one_on_sglang_servers_grade_alike(tmp_path, judge_dir, monkeypatch):
    from relax.services.launchers.process import NativeEngineProcess

    pairs = [(f"<answer>{i}</answer>", s) for i, s in enumerate(_ctx(str(tmp_path / "a")).split("train")[:4])]
    server = NativeEngineProcess(judge_dir, max_batch_size=8, log_dir=tmp_path)
    try:
        server.wait_healthy()
        judge = open_judge(_ctx(str(tmp_path / "a"), f"genrm.urls=[{server.url}]"))
        by_url = judge.score_many(pairs)
        assert judge.identity["urls"] == [server.url] and judge.identity["model_id"].startswith("urls:")
        judge.close()
    finally:
        server.stop()
    assert all(s.reward > 0.9 and not s.error for s in by_url)

    # genrm.engine=sglang: the reward role launches SGLang (a stand-in here) on the judge's copy and context
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    monkeypatch.setenv("RELAX_STANDIN_ARGV_DIR", str(argv_dir))
    judge = open_judge(_ctx(str(tmp_path / "b"), f"genrm.name_or_path={judge_dir}", "genrm.engine=sglang",
                            "genrm.engines=1", "rollout.sglang_module=tests.relax.engines.sglang.stand_in_server",
                            "model.max_seq_len=128"))
    try:
        by_sglang = judge.score_many(pairs)
    finally:
        judge.close()
    assert [s.reward for s in by_sglang] == pytest.approx([s.reward for s in by_url], abs=1e-5)
    (record,) = [json.loads(p.read_text()) for p in argv_dir.iterdir()]
    argv = record["argv"]
    assert os.path.basename(argv[argv.index("--model-path") + 1]).startswith("relax-judge-model-")
    assert argv[argv.index("--context-length") + 1] == "256"  # the judge's own (its config), not the policy's 128


STEPS = 30


def _post(url: str, body: dict, token: str) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


@pytest.mark.slow
def test_disaggregated_judge_pool_scales_out_and_in_through_the_rest_api(tmp_path, monkeypatch):
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
