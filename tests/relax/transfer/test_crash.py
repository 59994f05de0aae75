"""Crash safety: producer and consumer processes SIGKILLed at random points, then restarted.

After every iteration the store must hold every committed sample exactly once, every
consumed sample in exactly one step, and no torn shard may be visible.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from pathlib import Path

import pytest

from relax import objstore
from relax.transfer.consumer import load_group_state
from relax.transfer.queue import TransferQueue

WORKER = str(Path(__file__).with_name("crash_worker.py"))
GROUPS = 40
ITERATIONS = 50


def start(role: str, root: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, WORKER, role, root, str(GROUPS)], stderr=subprocess.PIPE)


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
        for _ in range(rng.randint(1, 3)):  # up to three crashes of random roles at random times
            time.sleep(rng.uniform(0.05, 0.5))
            victim = rng.choice(list(procs))
            interrupted += procs[victim].poll() is None  # still working when the kill came
            procs[victim].kill()
            procs[victim].wait()
            procs[victim] = start(victim, root)
        for role, proc in procs.items():
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"iteration {iteration}: {role} failed:\n{err.decode()[-2000:]}"
        check_store(root)
    assert interrupted >= ITERATIONS  # at least as many real mid-run kills as iterations
