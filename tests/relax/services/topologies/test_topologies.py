"""Async (Ray Serve) and disaggregated (three OS processes on S3) runs; an actor SIGKILLed mid-run.

Every check reads the run back from its manifests: no sample consumed twice, steps
contiguous, staleness within ``max_staleness``, one lineage chain.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest
import torch

from relax import objstore
from relax.services.driver import train
from relax.services.launchers.role_process import role_command
from relax.services.report.metrics import read_metrics
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from relax.transfer.weights import WeightStore
from tests.polling import poll_until, wait_until
from tests.relax.services.judges import yes_judge
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.ray
def test_async_topology_on_ray_serve(tmp_path, ray_session):
    from ray import serve

    # with the reference as a role of its own, and the reward role grading with a generative judge
    # (genrm, an engine inside its replica): each a Serve deployment of its own in this topology
    judge = yes_judge(str(tmp_path / "judge"))
    cfg = tiny_config(f"file://{tmp_path}/root", "async", "topology=async", "queue.max_staleness=1",
                      "trainer.total_steps=5", "algorithm.kl_coef=0.5", "algorithm.reference_role=true",
                      "data.reward_role=true", f"genrm.name_or_path={judge}")
    apps_seen: set[str] = set()
    real_run = serve.run

    def recording_run(app, name: str, **kwargs):
        apps_seen.add(name)
        return real_run(app, name=name, **kwargs)

    serve.run = recording_run
    try:
        result = train(cfg, progress=False)
    finally:
        serve.run = real_run
    assert result.steps == 5
    assert {"relax-async-reference", "relax-async-reward"} <= apps_seen
    assert [m["step"] for m in read_metrics(result.run_url, "reference")] == [0, 1, 2, 3, 4]
    reward = read_metrics(result.run_url, "reward")  # the judge's rewards (it says yes), each row once
    assert [m["step"] for m in reward] == [0, 1, 2, 3, 4] and reward[-1]["genrm/judged_total"] == 5 * 16
    assert all(m["reward"] > 0.9 for m in reward)
    stats = check_run(RunContext(cfg), 5)
    assert stats["max_staleness_seen"] <= 1
    # the rollout ran ahead of the actor: some batch was generated before the previous update landed
    assert any(m["weight_version"] < m["batch"] for m in result.metrics("rollout"))


@pytest.mark.s3
def test_disaggregated_processes_share_only_s3(s3_url):
    cfg = tiny_config(s3_url, "disagg", "topology=disaggregated", "queue.max_staleness=2")
    result = train(cfg, progress=False)
    assert result.steps == 4
    stats = check_run(RunContext(cfg), 4)
    assert stats["max_staleness_seen"] <= 2
    for role in ("actor", "advantage", "rollout"):  # each role's log, staged locally, uploaded to the bucket
        assert objstore.list_dir(f"{result.run_url}/logs/{role}") == ["0.log"]


def test_exact_staleness_repeats_a_disaggregated_run_whatever_the_timing(tmp_path):
    # the same run twice, the second with a rollout slowed below the actor's pace (its reward
    # sleeps): with bounded staleness it would load the newer versions it finds (measured:
    # batches 2-7 at lag 1, other final weights); exact staleness pins batch k to version k - 2
    helpers = "tests.relax.services.runtime_helpers"

    def run(name, reward):
        cfg = tiny_config(f"file://{tmp_path}/{name}", "exact", "topology=disaggregated", "queue.max_staleness=2",
                          "queue.exact_staleness=true", "trainer.total_steps=8",
                          "trainer.checkpoint_every=3", "queue.keep_checkpoints=1",  # older versions deleted early
                          "algorithm.entropy_coef=0.01",  # every update moves the policy, rewarded or not
                          f"data.reward_fn={helpers}:{reward}")
        result = train(cfg, progress=False)
        weights, _ = WeightStore(cfg.root, cfg.run_id).load()
        return result.metrics("rollout"), weights

    fast, fast_weights = run("fast", "task_reward")
    slow, slow_weights = run("slow", "slow_task_reward")
    assert any(m["newest_version"] > m["weight_version"] for m in slow), "the slow rollout never fell behind"
    for batches in (fast, slow):
        assert [m["weight_version"] for m in batches] == [max(0, k - 2) for k in range(8)]
    assert [m["reward"] for m in fast] == [m["reward"] for m in slow]
    assert fast_weights.keys() == slow_weights.keys()
    assert all(torch.equal(fast_weights[k], slow_weights[k]) for k in fast_weights), "the two runs diverged"


def _cfg_file(tmp_path, cfg) -> str:
    import json

    from relax.config import config_to_dict

    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(config_to_dict(cfg)))
    return str(path)


def test_actor_sigkill_then_restart_loses_nothing_and_changes_nothing(tmp_path):
    exact = ("queue.exact_staleness=true", "algorithm.entropy_coef=0.01")  # every update moves the policy
    cfg = tiny_config(f"file://{tmp_path}/root", "kill", "trainer.total_steps=8", "trainer.checkpoint_every=3",
                      "queue.max_staleness=1", *exact)
    ctx = RunContext(cfg)
    ensure_run(ctx)
    path = _cfg_file(tmp_path, cfg)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}

    def start(role):
        return subprocess.Popen(role_command(role, path), env=env, stdout=subprocess.DEVNULL,
                                stderr=open(tmp_path / f"{role}.log", "ab"))

    procs = {role: start(role) for role in ("actor", "advantage", "rollout")}
    def past_first_checkpoint() -> bool:  # (step 2), mid-interval
        assert procs["actor"].poll() is None, (tmp_path / "actor.log").read_text()[-2000:]
        return len(read_metrics(ctx.run_url, "actor")) >= 4

    wait_until(past_first_checkpoint, 240, interval=0.05, what=lambda: (tmp_path / "actor.log").read_text()[-2000:])
    os.kill(procs["actor"].pid, signal.SIGKILL)
    procs["actor"].wait()
    killed_at = len(read_metrics(ctx.run_url, "actor"))
    assert killed_at < 8
    procs["actor"] = start("actor")  # a restart: resumes from its last checkpoint and queue cursor
    for role, p in procs.items():
        assert p.wait(timeout=240) == 0, (tmp_path / f"{role}.log").read_text()[-2000:]
    stats = check_run(ctx, 8)
    assert stats["dropped"] == 0
    replayed = [m["step"] for m in read_metrics(ctx.run_url, "actor") if m.get("replayed")]
    assert replayed, "the restarted actor re-trained the recorded steps after its checkpoint"
    # with exact staleness the crash leaves no trace in the model: the same run, never killed, ends
    # on the same weights bit for bit (its steps replayed on the recorded samples, its batches
    # generated by the versions they would have been)
    calm = tiny_config(f"file://{tmp_path}/calm", "kill", "topology=disaggregated", "trainer.total_steps=8",
                       "trainer.checkpoint_every=3", "queue.max_staleness=1", *exact)
    train(calm, progress=False)
    killed, _ = WeightStore(cfg.root, "kill").load(8)
    uninterrupted, _ = WeightStore(calm.root, "kill").load(8)
    assert all(torch.equal(killed[k], uninterrupted[k]) for k in killed)


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/status") as f:
                    if f"\nPPid:\t{pid}\n" in f.read():
                        out.append(int(entry))
            except OSError:  # gone meanwhile
                pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "\nState:\tZ" not in f.read()  # a zombie has exited; only its reaper is missing
    except OSError:
        return False


def test_a_killed_disaggregated_driver_takes_its_role_processes_with_it(tmp_path):
    # orphaned roles would go on training into the run root that the rerun resumes: two actors
    cfg = tiny_config(f"file://{tmp_path}/root", "orphans", "topology=disaggregated", "trainer.total_steps=500")
    path = _cfg_file(tmp_path, cfg)
    code = ("import json, sys; from relax.config import RelaxConfig; from relax.services.driver import train; "
            "train(RelaxConfig.from_json(open(sys.argv[1]).read()), progress=False)")
    driver = subprocess.Popen([sys.executable, "-c", code, path], stdout=subprocess.DEVNULL,
                              stderr=open(tmp_path / "driver.log", "wb"))
    ctx = RunContext(cfg)
    def working() -> bool:  # every role is up and working
        assert driver.poll() is None, (tmp_path / "driver.log").read_text()[-2000:]
        return len(read_metrics(ctx.run_url, "actor")) >= 2

    try:
        wait_until(working, 240, interval=0.1, what="an actor step")
        roles = _children(driver.pid)
        assert len(roles) == 3, roles  # rollout, advantage, actor
    finally:
        driver.kill()
        driver.wait()
    poll_until(lambda: not any(_alive(pid) for pid in roles), 30, interval=0.1)
    survivors = [pid for pid in roles if _alive(pid)]
    for pid in survivors:  # don't leave them running past the test
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "role processes outlived their killed driver"
