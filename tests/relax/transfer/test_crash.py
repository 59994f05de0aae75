"""Crash safety: producer and consumer processes SIGKILLed at random points, then restarted.

After every iteration the store must hold every committed sample exactly once, every
consumed sample in exactly one step, and no torn shard may be visible.

The kill points are random points of the workers' *progress* (groups put or consumed, which
they report to a file), plus a random few milliseconds, not random wall-clock times: on a
fast machine a worker would otherwise be done before its kill, on a slow one still importing.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest

from relax import objstore
from relax.transfer.consumer import load_group_state
from relax.transfer.queue import TransferQueue
from tests.polling import wait_until

WORKER = str(Path(__file__).with_name("crash_worker.py"))
GROUPS = 40
ITERATIONS = 36  # seeded; 50 until the suite neared its 30-minute budget (each iteration 1-3 kills)


def start(role: str, root: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, role, root, str(GROUPS), progress_file(root, role)],
                            stderr=subprocess.PIPE)


def progress_file(root: str, role: str) -> str:
    return f"{root}.{role}.progress"  # beside the store, not in it


def progress(root: str, role: str) -> int:
    """Groups the role has put or consumed so far, over all its incarnations (0 before the first)."""
    try:
        return int(Path(progress_file(root, role)).read_text())
    except FileNotFoundError:
        return 0


def reached(root: str, role: str, proc: subprocess.Popen, groups: int) -> bool:
    return progress(root, role) >= groups or proc.poll() is not None


def check_store(root: str) -> dict:
    q = TransferQueue(root, "run", "rollouts")
    expected = {f"g{k}/{i}" for k in range(GROUPS) for i in range(2)}
    assert set(q.state.samples) == expected, "a committed sample was lost or an extra one appeared"
    assert not q.state.duplicates, f"samples committed twice: {sorted(q.state.duplicates)[:4]}"
    for name in q.state.shards:  # every committed shard reads back and matches its checksum
        q.load_shard(name)
    st = load_group_state(q, "actor")
    consumed = [sid for step in sorted(st.steps) for sid in st.steps[step]["ids"]]
    assert len(consumed) == len(set(consumed)), "a sample was consumed twice"
    assert set(consumed) == expected and not st.dropped
    assert sorted(st.steps) == list(range(len(st.steps))), "a step is missing"
    return {"steps": len(st.steps), "incarnations": len(objstore.list_dir(objstore.join(q.url, "log")))}


@pytest.mark.slow
def test_sigkill_at_random_points(tmp_path):
    interrupted = 0
    for iteration in range(ITERATIONS):
        rng = random.Random(iteration)
        root = str(tmp_path / f"it{iteration}")
        procs = {"producer": start("producer", root), "consumer": start("consumer", root)}
        for _ in range(rng.randint(1, 3)):  # up to three crashes of random roles at random points
            victim = rng.choice(list(procs))
            done = progress(root, victim)
            if done >= GROUPS:
                continue  # finished already: nothing left to interrupt
            # kill it once it got past a random point well short of its last commit (at the first
            # point this incarnation may still be importing), a few ms later so some kills land mid-write
            target = rng.randint(done, max(done, GROUPS - 6))
            wait_until(partial(reached, root, victim, procs[victim], target), timeout=120,
                       what=f"iteration {iteration}: {victim} to pass {target} of {GROUPS} groups")
            time.sleep(rng.uniform(0, 0.01))
            code = procs[victim].poll()
            assert code in (None, 0), f"iteration {iteration}: {victim} failed:\n{procs[victim].stderr.read().decode()}"
            interrupted += code is None and progress(root, victim) < GROUPS  # still working when the kill came
            procs[victim].kill()
            procs[victim].wait()
            procs[victim] = start(victim, root)
        for role, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"iteration {iteration}: {role} failed:\n{err.decode()[-2000:]}"
        check_store(root)
    assert interrupted >= ITERATIONS  # at least as many real mid-run kills as iterations
