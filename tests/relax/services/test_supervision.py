"""The restart policy (backoff, window, limit, user errors), the restart records that
``relax status`` and lineage read, and the role log files (rotation, the last exception)."""

from __future__ import annotations

import io
import os
import subprocess
import tempfile

import pytest

from relax.config import SupervisorConfig
from relax.services.launchers.lifetime import owned_temp_dir, sweep_temp_dirs
from relax.services.launchers.role_process import describe_exit
from relax.services.report.role_logs import RoleLogFile, last_traceback, next_attempt, role_error
from relax.services.supervision import RestartPolicy, RoleFailure, RunStopped, Supervisor, read_restarts


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def failure(role="actor", healable=True) -> RoleFailure:
    return RoleFailure(role, 0, "signal 9 (SIGKILL)", "Traceback ...\nRuntimeError: boom", "/runs/x/logs/actor/0.log",
                       healable=healable)


def test_backoff_doubles_within_the_window_and_the_limit_stops_the_run():
    clock = Clock()
    policy = RestartPolicy(SupervisorConfig(max_restarts=3, restart_window_s=100, backoff_s=1.0, backoff_max_s=3.0),
                           clock)
    # failures 1, 2, 3 in the window: 1 * 2**0 = 1, 1 * 2**1 = 2, 1 * 2**2 = 4 capped at 3
    assert [policy.after_failure(failure()) for _ in range(3)] == [1.0, 2.0, 3.0]
    assert policy.after_failure(failure("rollout")) == 1.0  # counted per role
    with pytest.raises(RunStopped, match=r"(?s)role actor failed 4 times within 100 s \(supervisor.max_restarts=3\).*"
                                         r"signal 9 \(SIGKILL\), full log: /runs/x/logs/actor/0.log\n.*boom"):
        policy.after_failure(failure())


def test_failures_older_than_the_window_are_forgotten():
    clock = Clock()
    policy = RestartPolicy(SupervisorConfig(max_restarts=1, restart_window_s=10, backoff_s=0.5), clock)
    assert policy.after_failure(failure()) == 0.5
    clock.now = 10.5  # the first failure left the window: this one is the first again
    assert policy.after_failure(failure()) == 0.5
    clock.now = 11.0
    with pytest.raises(RunStopped):
        policy.after_failure(failure())


def test_a_users_error_is_never_restarted():
    policy = RestartPolicy(SupervisorConfig(max_restarts=5))
    with pytest.raises(RunStopped, match=r"role actor failed with an error a restart would repeat"):
        policy.after_failure(failure(healable=False))


def test_restarts_are_recorded_in_the_run_and_counted_per_role(tmp_path):
    run = f"file://{tmp_path}/run"
    notes: list[str] = []
    for role in ("actor", "rollout", "actor"):  # two controller incarnations: both are counted
        Supervisor(run, SupervisorConfig(backoff_s=0.0), notify=notes.append).failed(failure(role))
    assert read_restarts(run) == {"actor": 2, "rollout": 1}
    assert "role rollout failed (signal 9 (SIGKILL): RuntimeError: boom); restarting it in 0.0 s" in notes[1]


def test_log_files_number_attempts_over_the_runs_life_and_rotate(tmp_path):
    run = f"file://{tmp_path}/run"
    assert next_attempt(run, "actor") == 0
    log = RoleLogFile(run, "actor", next_attempt(run, "actor"), str(tmp_path / "stage"), max_bytes=10, backups=1)
    assert log.path == str(tmp_path / "run/logs/actor/0.log")  # a local root: written in place
    thread = log.pump(io.BufferedReader(io.BytesIO(b"first line\n")))
    thread.join()
    log.write(b"second\n")  # 11 + 7 > 10 bytes: the first goes to 0.log.1
    log.write(b"third\n")  # 7 + 6 > 10: the second replaces it, and only one backup is kept
    log.close()
    assert open(log.path).read() == "third\n" and open(log.path + ".1").read() == "second\n"
    assert next_attempt(run, "actor") == 1


def test_on_an_object_store_root_the_log_is_staged_and_uploaded(tmp_path):
    import fsspec

    fs = fsspec.filesystem("memory")
    log = RoleLogFile("memory://bucket/run", "rollout", 0, str(tmp_path), max_bytes=1 << 20, backups=2)
    assert log.path.startswith(str(tmp_path)) and log.where == "memory://bucket/run/logs/rollout/0.log"
    log.write(b"hello\n")
    log.close()
    assert fs.cat("memory://bucket/run/logs/rollout/0.log") == b"hello\n"


def test_the_last_exception_is_the_reported_one_else_the_last_traceback_in_the_log(tmp_path):
    run = f"file://{tmp_path}/run"
    log = RoleLogFile(run, "rollout", 0, str(tmp_path), max_bytes=1 << 20, backups=0)
    log.write(b"Traceback (most recent call last):\n  File x\nValueError: the real one\n"
              b"Future exception was never retrieved\nTraceback (most recent call last):\n"
              b"  File y\nConnectionRefusedError: noise\n")
    log.close()
    reported = tmp_path / "rollout.error"
    assert role_error(str(reported), log).endswith("ConnectionRefusedError: noise")  # nothing reported
    reported.write_text("Traceback (most recent call last):\nValueError: the real one\n")
    assert role_error(str(reported), log).strip().endswith("ValueError: the real one")
    assert last_traceback("no traceback here") is None


def test_exits_are_described_by_signal_name():
    assert describe_exit(-9) == "signal 9 (SIGKILL)"
    assert describe_exit(1) == "exit code 1"


def test_a_temp_folder_is_swept_only_once_its_owner_is_gone():
    mine = owned_temp_dir("relax-roles-")
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs
    orphan = tempfile.mkdtemp(prefix=f"relax-roles-{dead.pid}.1-")
    try:
        swept = sweep_temp_dirs()
        assert os.path.basename(orphan) in swept and not os.path.exists(orphan)
        assert os.path.isdir(mine)
    finally:
        os.rmdir(mine)
    with pytest.raises(ValueError, match="not swept"):
        owned_temp_dir("relax-other-")
