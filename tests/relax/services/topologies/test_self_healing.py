"""Runs that heal themselves: roles killed at named points (RELAX_FAULT) are restarted by the
controller, the run finishes with nothing lost or doubled, and a fault that repeats stops it
with an error naming the role, the fault and the log file.

Every check reads the run back from the store: the queue's manifests (check_run), the weight
store, the restart records (``relax status``) and the lineage records.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

from relax.cli.train_cmd import run_status
from relax.config import ConfigError
from relax.services.driver import train
from relax.services.queue_contract import ACTOR_GROUP, ADVANTAGE_GROUP, REFERENCE_GROUP
from relax.services.report.metrics import read_metrics
from relax.services.run_context import RunContext
from relax.services.supervision import RunStopped
from relax.transfer.consumer import load_group_state
from relax.transfer.lineage import chain
from relax.transfer.weights import WeightStore
from tests.polling import wait_until
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow

# exact staleness: a run is a function of its config, however its roles were timed or killed
EXACT = ("queue.max_staleness=1", "queue.exact_staleness=true", "algorithm.entropy_coef=0.01",
         "supervisor.backoff_s=0.1")


def _final_weights(cfg, steps):
    return WeightStore(cfg.root, cfg.run_id).load(steps)[0]


def _check_columns(ctx: RunContext, groups: tuple[str, ...], fields: tuple[str, ...]) -> None:
    """Every column stage took each sample once, and every trained sample carries its columns."""
    queue = ctx.queue()
    queue.refresh()
    trained = {sid for rec in load_group_state(queue, ACTOR_GROUP).steps.values() for sid in rec["ids"]}
    for group in groups:
        taken = [sid for rec in load_group_state(queue, group).steps.values() for sid in rec["ids"]]
        assert len(taken) == len(set(taken)), f"{group} took a sample twice"
        assert trained <= set(taken)
    for sid in trained:
        missing = [f for f in fields if f not in queue.state.samples[sid].locs]
        assert not missing, f"trained sample {sid} lacks {missing}"


def _heal(tmp_path, killed_root: str, run_id: str, faults: str, monkeypatch):
    """A 6-step disaggregated run with ``faults`` injected, checked whole and against the same run
    never killed (on a local folder): bit-identical final weights. Returns (config, train result)."""
    def config(root: str):
        return tiny_config(root, run_id, "topology=disaggregated", "trainer.total_steps=6",
                           "trainer.checkpoint_every=3", *EXACT)

    calm = config(f"file://{tmp_path}/calm")
    train(calm, progress=False)
    cfg = config(killed_root)
    monkeypatch.setenv("RELAX_FAULT", faults)
    result = train(cfg, progress=False)  # one call: the controller restarts them itself
    assert result.steps == 6
    check_run(RunContext(cfg), 6)
    _check_columns(RunContext(cfg), (ADVANTAGE_GROUP,), ("advantages",))
    killed, uninterrupted = _final_weights(cfg, 6), _final_weights(calm, 6)
    assert all(torch.equal(killed[k], uninterrupted[k]) for k in killed), "the healed run diverged"
    return cfg, result


def test_each_role_killed_once_heals_to_the_weights_of_the_run_never_killed(tmp_path, monkeypatch):
    # actor mid-step (recorded, not trained), advantage between recording and committing, rollout after a batch
    cfg, result = _heal(tmp_path, f"file://{tmp_path}/killed", "heal",
                        "actor:recorded:4:1,advantage:recorded:2:1,rollout:step:1:1", monkeypatch)
    status = run_status(cfg.root, "heal")
    assert status["restarts"] == {"actor": 1, "advantage": 1, "rollout": 1}
    assert {role: info["restarts"] for role, info in status["roles"].items()} == {
        "actor": 1, "advantage": 1, "rollout": 1}
    assert chain(cfg.root, "heal")[0].extra["restarts"] == {"actor": 1, "advantage": 1, "rollout": 1}
    assert max(m["attempt"] for m in read_metrics(result.run_url, "actor")) == 1  # the restart reported
    logs = tmp_path / "killed/runs/heal/logs"
    for role in ("actor", "advantage", "rollout"):  # each attempt's full log, the fault named in the first
        assert sorted(os.listdir(logs / role)) == ["0.log", "1.log"]
        assert f"injected fault {role}:" in (logs / role / "0.log").read_text()


@pytest.mark.s3
def test_on_s3_a_killed_actor_and_advantage_heal_to_the_weights_of_the_run_never_killed(tmp_path, monkeypatch,
                                                                                          s3_url):
    # a restarted role lists every writer's log as it opens the topic; on S3 that listing used to be
    # cached and trusted, so the records written after it never appeared and the run hung (issue 63)
    cfg, _ = _heal(tmp_path, f"{s3_url}/killed", "s3heal", "actor:recorded:4:1,advantage:recorded:2:1", monkeypatch)
    assert run_status(cfg.root, "s3heal")["restarts"] == {"actor": 1, "advantage": 1}


def _stop_role_after_its_first_step(run_url: str, role: str, stopped: list[int], done) -> None:
    """SIGSTOP ``role``'s process (named by its heartbeat) once it has reported a step."""
    from relax.services.heartbeat import read_heartbeat

    while not done.is_set():
        beat = read_heartbeat(run_url, role)
        if beat and beat["attempt"] == 0 and beat["step"] is not None:
            os.kill(beat["pid"], signal.SIGSTOP)
            stopped.append(beat["pid"])
            return
        time.sleep(0.05)


def _train_freezing(cfg, role: str) -> int:
    """Train ``cfg`` while ``role`` is SIGSTOPped after its first step; the steps trained."""
    import threading

    stopped: list[int] = []
    done = threading.Event()
    freezer = threading.Thread(target=_stop_role_after_its_first_step,
                               args=(RunContext(cfg).run_url, role, stopped, done))
    freezer.start()
    try:
        steps = train(cfg, progress=False).steps
    finally:
        done.set()
        freezer.join()
        for pid in stopped:  # never left stopped, whatever happened
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert stopped, f"the {role} role never reported a step"
    return steps


def _frozen_advantage_run(root: str, run_id: str, topology: str) -> dict:
    """A 6-step run whose advantage role is frozen after its first step; ``relax status`` after it,
    once the run is checked whole (nothing lost or doubled)."""
    cfg = tiny_config(root, run_id, f"topology={topology}", "trainer.total_steps=6",
                      "supervisor.hang_timeout_s=20", "supervisor.heartbeat_s=0.1", *EXACT)
    assert _train_freezing(cfg, "advantage") == 6
    ctx = RunContext(cfg)
    check_run(ctx, 6)
    _check_columns(ctx, (ADVANTAGE_GROUP,), ("advantages",))
    return run_status(cfg.root, run_id)


def test_a_role_frozen_past_the_hang_timeout_is_killed_and_restarted(tmp_path):
    status = _frozen_advantage_run(f"file://{tmp_path}", "frozen", "disaggregated")
    # the others waited for it all along: waiting is progress, so only the frozen role was restarted
    assert status["restarts"] == {"advantage": 1}
    reason = status["roles"]["advantage"]["last_restart"]
    assert reason.startswith("no progress for ") and reason.endswith(" s (hung; killed)")
    assert 20 <= float(reason.split()[3]) < 60
    assert status["roles"]["advantage"]["attempt"] == 1 and status["roles"]["actor"]["attempt"] == 0
    first = (tmp_path / "runs/frozen/logs/advantage/0.log").read_text()
    assert "most recent call first" in first  # its stacks (faulthandler), as it was killed


@pytest.mark.parametrize("fault", ["reference:recorded:1:1", "actor:publish:2:1", "rollout:start::1",
                                   "reference:start::1"])
def test_every_injection_point_heals_with_nothing_lost_or_doubled(tmp_path, monkeypatch, fault):
    cfg = tiny_config(f"file://{tmp_path}", "points", "topology=disaggregated", "algorithm.kl_coef=0.01",
                      "algorithm.reference_role=true", *EXACT)
    monkeypatch.setenv("RELAX_FAULT", fault)
    assert train(cfg, progress=False).steps == 4
    ctx = RunContext(cfg)
    check_run(ctx, 4)
    _check_columns(ctx, (ADVANTAGE_GROUP, REFERENCE_GROUP), ("advantages", "ref_logprobs"))
    assert run_status(cfg.root, "points")["restarts"] == {fault.split(":")[0]: 1}


def test_a_fault_that_repeats_stops_the_run_naming_role_fault_and_log(tmp_path, monkeypatch):
    cfg = tiny_config(f"file://{tmp_path}", "again", "topology=disaggregated", "supervisor.max_restarts=1",
                      "supervisor.backoff_s=0.1")
    monkeypatch.setenv("RELAX_FAULT", "advantage:start")  # every attempt
    with pytest.raises(RunStopped) as stopped:
        train(cfg, progress=False)
    message = str(stopped.value)
    assert "role advantage failed 2 times" in message and "signal 9 (SIGKILL)" in message
    assert "injected fault advantage:start (attempt 1" in message  # the fault, from the log's last line
    log = str(tmp_path / "runs/again/logs/advantage/1.log")
    assert f"full log: {log}" in message and os.path.exists(log)
    assert run_status(cfg.root, "again")["restarts"] == {"advantage": 1}


def test_a_role_that_fails_on_bad_input_is_not_restarted(tmp_path):
    # a user's error that only the role meets (the controller's checks passed): restarts would repeat it
    cfg = tiny_config(f"file://{tmp_path}", "bad", "topology=disaggregated", "supervisor.backoff_s=0.1",
                      "rollout.env_fn=tests.relax.services.runtime_helpers:refusing_env")
    with pytest.raises(RunStopped, match=r"(?s)role rollout failed with an error a restart would repeat "
                                         r"\(exit code 2\).*ConfigError: this env cannot run task"):
        train(cfg, progress=False)
    assert run_status(cfg.root, "bad")["restarts"] == {}


def test_a_malformed_fault_spec_is_refused_before_the_run_starts(tmp_path, monkeypatch):
    monkeypatch.setenv("RELAX_FAULT", "actor:nowhere")
    cfg = tiny_config(f"file://{tmp_path}", "spec", "topology=disaggregated")
    with pytest.raises(ConfigError, match=r"RELAX_FAULT spec 'actor:nowhere' is malformed"):
        train(cfg, progress=False)
    assert not os.path.exists(tmp_path / "runs/spec/run.json")


def test_colocated_run_heals_a_failed_step_in_process(tmp_path, monkeypatch):
    calm = tiny_config(f"file://{tmp_path}/calm", "co", "trainer.total_steps=4", *EXACT)
    train(calm, progress=False)
    cfg = tiny_config(f"file://{tmp_path}/killed", "co", "trainer.total_steps=4", *EXACT)
    monkeypatch.setenv("RELAX_FAULT", "actor:recorded:2:1")
    assert train(cfg, progress=False).steps == 4
    check_run(RunContext(cfg), 4)
    killed, uninterrupted = _final_weights(cfg, 4), _final_weights(calm, 4)
    assert all(torch.equal(killed[k], uninterrupted[k]) for k in killed)
    assert run_status(cfg.root, "co")["restarts"] == {"actor": 1}


def test_the_only_engine_process_dying_while_it_loads_weights_is_survived(tmp_path, monkeypatch):
    cfg = tiny_config(f"file://{tmp_path}", "engine", "rollout.engine_processes=1", "rollout.engine_timeout_s=120",
                      "trainer.total_steps=4", *EXACT)
    monkeypatch.setenv("RELAX_FAULT", "engine:load:2:1")  # the first engine dies loading version 2
    result = train(cfg, progress=False)
    assert result.steps == 4
    check_run(RunContext(cfg), 4)
    rollout = result.metrics("rollout")
    assert max(m["engines_replaced"] for m in rollout) == 1
    assert [m["weight_version"] for m in rollout] == [0, 0, 1, 2]  # version 2 reached the replacement
    engine_logs = os.listdir(tmp_path / "runs/engine/logs/engines")
    assert run_status(cfg.root, "engine")["restarts"] == {}  # the rollout itself never failed
    # the engine that died and its replacement (on a loaded machine a replacement that does not come
    # up in time is stopped and started again: more logs, still one death)
    assert len(engine_logs) >= 2
    assert sum("injected fault engine:load:2" in (tmp_path / "runs/engine/logs/engines" / n).read_text()
               for n in engine_logs) == 1


def test_the_only_engine_killed_as_its_rollout_starts_it_is_replaced_not_the_rollout(tmp_path, monkeypatch):
    cfg = tiny_config(f"file://{tmp_path}", "estart", "topology=disaggregated", "rollout.engine_processes=1", *EXACT)
    monkeypatch.setenv("RELAX_FAULT", "engine:start::1")  # the first launch's engine; its replacement lives
    result = train(cfg, progress=False)
    assert result.steps == 4
    check_run(RunContext(cfg), 4)
    assert run_status(cfg.root, "estart")["restarts"] == {}  # the rollout itself never failed
    assert max(m["engines_replaced"] for m in result.metrics("rollout")) == 1
    logs = tmp_path / "runs/estart/logs/engines"
    assert sum("injected fault engine:start" in (logs / n).read_text() for n in os.listdir(logs)) == 1


def test_an_engine_that_fails_as_it_starts_quotes_its_error_not_its_progress(tmp_path):
    from relax.services.launchers.process import EngineStartFailed, LocalProcessLauncher

    bad = tmp_path / "not-a-model"
    bad.mkdir()
    (bad / "config.json").write_text('{"model_type": "no-such-architecture"}')
    launcher = LocalProcessLauncher(bad, max_engines=1, startup_timeout_s=120, log_dir=tmp_path)
    with pytest.raises(EngineStartFailed) as failed:
        launcher.launch_surviving(1)  # an error of its own is not spared: a replacement would repeat it
    assert not failed.value.killed
    message = str(failed.value)
    assert "exited with code" in message and "Traceback (most recent call last)" in message
    log = next(tmp_path.glob("relax-engine-*.log")).read_text()
    raised = [ln for ln in log.splitlines() if re.match(r"^\w+(Error|Exception): ", ln)][-1]
    assert raised in message  # the exception itself, not the last line the engine printed
    assert launcher.running() == []


def _relax_entries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("relax-"))


def test_a_killed_controller_and_its_rerun_leave_no_temp_folders(tmp_path):
    temp = tmp_path / "tmp"
    temp.mkdir()
    args = [sys.executable, "-m", "relax.cli.main", "train", "tiny-cpu", f"root=file://{tmp_path}/root",
            "run_id=orphan", "topology=disaggregated", "data.tasks=[arithmetic]", "data.train_per_task=64",
            "data.eval_per_task=8", "rollout.prompts_per_step=4", "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8", "trainer.total_steps=6", "trainer.checkpoint_every=2",
            "rollout.engine_processes=1", "--no-progress"]
    env = {**os.environ, "TMPDIR": str(temp), "RELAX_ENGINE_REGISTRY": str(temp / "relax-engines-test")}
    env.pop("RELAX_FAULT", None)
    driver = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def both_exist() -> bool:  # killed while its roles' folder and the rollout's engine model copy both exist
        assert driver.poll() is None, driver.stderr.read().decode()[-3000:]
        return all(any(n.startswith(p) for n in _relax_entries(temp)) for p in ("relax-roles-", "relax-engine-model-"))

    wait_until(both_exist, 240, interval=0.05, what="the roles' folder and the engine model copy")
    driver.send_signal(signal.SIGKILL)
    driver.wait()
    rerun = subprocess.run(args, env=env, capture_output=True, text=True, timeout=400)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert _relax_entries(temp) == []


@pytest.mark.ray
def test_async_run_restarts_a_failed_role_loop_in_its_replica(tmp_path, monkeypatch, ray_session):
    cfg = tiny_config(f"file://{tmp_path}", "asyncheal", "topology=async", *EXACT)
    monkeypatch.setenv("RELAX_FAULT", "advantage:recorded:1:1")  # reaches the replica in its runtime env
    assert train(cfg, progress=False).steps == 4
    ctx = RunContext(cfg)
    check_run(ctx, 4)
    _check_columns(ctx, (ADVANTAGE_GROUP,), ("advantages",))
    assert run_status(cfg.root, "asyncheal")["restarts"] == {"advantage": 1}


@pytest.mark.ray
def test_async_run_replaces_a_replica_whose_role_froze(tmp_path, ray_session):
    status = _frozen_advantage_run(f"file://{tmp_path}", "asyncfrozen", "async")
    assert status["restarts"] == {"advantage": 1}
    assert status["roles"]["advantage"]["last_restart"].startswith("no progress for ")


def test_a_colocated_process_that_makes_no_progress_ends_itself_with_its_stacks(tmp_path):
    script = ("import time\nfrom relax import liveness\nfrom relax.services.heartbeat import SelfWatch\n"
              "w = SelfWatch(timeout_s=1.0, check_s=0.1)\n"
              "for _ in range(10):\n    time.sleep(0.3); liveness.mark()\n"  # 3 s of progress: no exit
              "print('progressed', flush=True)\n"
              "time.sleep(60)\n")  # then stuck
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    from relax.services.heartbeat import HUNG_EXIT

    assert proc.returncode == HUNG_EXIT
    assert proc.stdout == "progressed\n"
    assert "relax: no progress for 1 s (supervisor.hang_timeout_s=1)" in proc.stderr
    assert "most recent call first" in proc.stderr and "<module>" in proc.stderr  # where it was stuck
