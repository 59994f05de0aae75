"""Engine processes die with the process that owns them, and a new owner ends any left behind
(issue 46, a: after a SIGKILLed rollout its engine servers kept running).

The chaos test SIGKILLs a real owner (a Python process running a rollout's engine pool with its
supervisor over two engine processes, one of them SIGSTOPped) and finds no engine alive
afterwards. The others take each mechanism of ``relax.services.launchers.lifetime`` apart: the
spawner thread, the watchdog on the owner's pid and start time, and the reaper that a new
incarnation runs before it starts engines, which never kills a process that reused a pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from relax.services.launchers import lifetime
from relax.services.launchers.process import NativeEngineProcess
from tests.polling import poll_until
from tests.relax.engines.contract import save_tiny_model

REPO = Path(__file__).resolve().parents[4]
SLEEP = "import time; time.sleep(600)"


@pytest.fixture(autouse=True)
def registry(tmp_path, monkeypatch) -> Path:
    """A registry of this test's own (subprocesses inherit it through the environment)."""
    folder = tmp_path / "registry"
    monkeypatch.setenv("RELAX_ENGINE_REGISTRY", str(folder))
    return folder


def gone(pid: int, timeout_s: float = 60.0) -> bool:
    """Poll until ``pid`` no longer runs (a zombie counts as gone); False at the deadline."""
    return poll_until(lambda: lifetime.start_time(pid) is None, timeout_s, interval=0.05)


def processes_with(token: str) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and token in lifetime.cmdline(int(p))]


def python(code: str, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-c", code, *args], cwd=REPO, env=env, **kwargs)


def kill(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def test_a_process_is_known_by_its_pid_and_start_time():
    me = os.getpid()
    assert lifetime.is_running(me, lifetime.start_time(me))
    assert not lifetime.is_running(me, "1")  # the same number, another process: a reused pid
    done = python("pass")
    done.wait()
    assert lifetime.start_time(done.pid) is None


def test_an_engine_forked_on_behalf_of_a_short_lived_thread_outlives_that_thread():
    # the parent-death signal follows the forking thread: forked by that thread itself, the child
    # would be killed as soon as the thread ended, with its owner still running
    started: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: started.append(lifetime.spawn(
        lifetime.dying_with_owner([sys.executable, "-c", SLEEP], os.getpid()), start_new_session=True)))
    t.start()
    t.join()
    [child] = started
    try:
        time.sleep(1.0)  # long enough for a signal sent at the thread's end to have landed
        assert child.poll() is None
    finally:
        kill(child)


def test_the_watchdog_ends_an_engine_whose_owner_is_gone_even_when_not_its_parent():
    owner = python(SLEEP)
    start = lifetime.start_time(owner.pid)
    watched = python(f"from relax.services.launchers.lifetime import watch_owner; watch_owner({owner.pid}, "
                     f"{start!r}, interval_s=0.1); {SLEEP}")
    try:
        time.sleep(1.0)
        assert watched.poll() is None  # a running owner keeps it
        kill(owner)
        watched.wait(timeout=60)
        assert watched.returncode == 0
    finally:
        kill(owner)
        kill(watched)


LEFTOVER = """
import os, subprocess, sys, time
from relax.services.launchers import lifetime
token = sys.argv[1]
# an engine whose protections failed: no parent-death signal, no watchdog, only its record
p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", lifetime.REGISTRY_FLAG, token],
                     start_new_session=True)
lifetime.record(p.pid, token, os.getpid())
print(p.pid, flush=True)
time.sleep(600)
"""


def test_a_new_incarnation_ends_the_engine_its_predecessor_left_before_starting_its_own(tmp_path, registry):
    token = uuid.uuid4().hex
    old = python(LEFTOVER, token, stdout=subprocess.PIPE, text=True)
    leftover = int(old.stdout.readline())
    kill(old)  # the previous rollout, SIGKILLed
    try:
        assert not gone(leftover, timeout_s=1.0)  # it survived its owner
        assert len(list(registry.glob("*.json"))) == 1
        # the next incarnation starts an engine (a model that does not exist: only the reaping counts here)
        engine = NativeEngineProcess(tmp_path / "no-model", log_dir=tmp_path)
        engine.stop()
        assert gone(leftover) and processes_with(token) == []
        assert list(registry.glob("*.json")) == []  # its record went with it; the new engine's on stop()
    finally:
        if lifetime.start_time(leftover) is not None:
            os.killpg(leftover, signal.SIGKILL)


def test_the_reaper_never_kills_a_process_that_reused_a_pid_or_one_whose_owner_runs(registry):
    owner, dead_owner = python(SLEEP), python(SLEEP)
    unrelated, owned = python(SLEEP), python(SLEEP, lifetime.REGISTRY_FLAG, "live-owner")
    try:
        # a record whose pid now belongs to an unrelated process (no token on its command line)
        lifetime.record(unrelated.pid, "reused-pid", dead_owner.pid)
        lifetime.record(owned.pid, "live-owner", owner.pid)
        kill(dead_owner)
        assert lifetime.reap_orphans() == []
        assert unrelated.poll() is None and owned.poll() is None
        assert [p.name for p in registry.glob("*.json")] == [f"{owned.pid}-live-owner.json"]
    finally:
        for p in (owner, dead_owner, unrelated, owned):
            kill(p)


OWNER = """
import sys, time
from relax.rollout.remote_engines import RemoteEngines
from relax.services.launchers.process import LocalProcessLauncher
launcher = LocalProcessLauncher(sys.argv[1], max_engines=2, max_batch_size=4, log_dir=sys.argv[2])
engines = launcher.launch(2)  # healthy
pool = RemoteEngines([], owned=engines, launcher=launcher, supervise_interval_s=0.5)
for e in engines:
    print(e.proc.pid, e.token, e.url, flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_sigkilling_a_rollout_leaves_none_of_its_engine_processes_alive(tmp_path, registry):
    model = save_tiny_model(tmp_path / "model")
    owner = python(OWNER, str(model), str(tmp_path), stdout=subprocess.PIPE, text=True)
    try:
        engines = [owner.stdout.readline().split() for _ in range(2)]
        assert all(len(e) == 3 for e in engines), f"the owner did not start its engines: {engines}"
        pids = [int(pid) for pid, _, _ in engines]
        assert all(lifetime.start_time(p) is not None for p in pids)
        os.kill(pids[1], signal.SIGSTOP)  # a hung engine never handles a SIGTERM
        kill(owner)  # SIGKILL: no stop(), no atexit, nothing of the owner's own runs
        assert all(gone(p) for p in pids), [lifetime.cmdline(p) for p in pids]
        assert all(processes_with(token) == [] for _, token, _ in engines)
        assert lifetime.reap_orphans() == []  # nothing left to reap; the stale records are dropped
        assert list(registry.glob("*.json")) == []
    finally:
        kill(owner)
