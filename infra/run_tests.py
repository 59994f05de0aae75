"""``make test``: the suite as two pytest sessions side by side, one per core of a 2-core machine.

One pytest session keeps about one core busy (most tests wait on a child process, a server or a
Ray actor), so the suite runs as two sessions at once, split by what they share:

* ``local``: what runs without a Ray cluster or Flyte (the engine's parts: trainers, algorithms,
  data, models, rollout, transfer, engines, config, docs; the roles' and learning tests, whose
  runs are processes of their own; and the cluster emulator's, whose Ray clusters are its own), its output kept in
  ``.pytest_local.log`` and printed when both
  are done;
* ``cluster``: everything else (the session's Ray cluster and Serve apps, launchers, topologies,
  CLI, Flyte tasks and workflows), printed as it runs.

``LOCAL`` is balanced by hand: on the 2-core reference machine the two finish within about two minutes
of each other.

Each session has its own ``RELAX_TEST_GROUP``, so the Flyte folder clean-up (tests/conftest.py) and
the moto log are its own. Exit status: the first failing session's, where a session that collected
no tests (pytest's 5) fails unless the caller's arguments filtered it empty and the other ran tests.
Arguments that name test paths run one session over just those paths.

    python infra/run_tests.py [pytest args...]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCAL = [
    "tests/relax/trainers",
    "tests/relax/algorithms",
    "tests/relax/data",
    "tests/relax/models",
    "tests/relax/rollout",
    "tests/relax/transfer",
    "tests/relax/engines",
    "tests/relax/config",
    "tests/relax/test_objstore.py",
    "tests/test_docs.py",
    "tests/test_layers.py",
    "tests/test_repo.py",
    "tests/relax/services/roles",  # every role's test; their runs are processes of their own
    "tests/relax/services/test_learning.py",
    "tests/relax/services/test_video_learning.py",
    # the cluster emulator starts Ray clusters and an S3 server of its own, not the session's
    "tests/workflows/test_cluster.py",
]
NO_TESTS = 5  # pytest's exit code when nothing was collected


def _pytest() -> str:
    # the pytest script, not python -m: flytekit names tasks relative to sys.argv[0]
    return str(Path(sys.executable).with_name("pytest"))


def _names_paths(args: list[str]) -> bool:
    return any(not a.startswith("-") and (REPO / a.split("::")[0]).exists() for a in args)


def main(args: list[str]) -> int:
    base = [_pytest(), "-m", "not gpu", *args]
    if _names_paths(args):
        return subprocess.call(base, cwd=REPO)
    # one thread per torch process: two sessions' OpenMP pools of two threads each would oversubscribe
    # the two cores (their spin-waits burn the CPU the other session needs)
    threads = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    log = REPO / ".pytest_local.log"
    start = time.monotonic()
    with open(log, "wb") as out:
        local = subprocess.Popen([*base, *LOCAL], cwd=REPO, stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, **threads, "RELAX_TEST_GROUP": "local"})
        cluster_rc = subprocess.call([*base, "tests", *(f"--ignore={e}" for e in LOCAL)], cwd=REPO,
                                  env={**os.environ, **threads, "RELAX_TEST_GROUP": "cluster"})
        local_rc = local.wait()
    print(f"\n===== local session ({log.name}) =====", flush=True)
    sys.stdout.write(log.read_text(errors="replace"))
    print(f"\n===== both sessions done in {time.monotonic() - start:.0f} s: cluster rc={cluster_rc}, "
          f"local rc={local_rc} =====", flush=True)
    return combined([cluster_rc, local_rc], filtered=bool(args))


def combined(codes: list[int], filtered: bool) -> int:
    """One exit status for the sessions' ``codes``: the first failure's; pytest's 5 (no tests) is a
    failure unless the caller's arguments ``filtered`` one session empty while another ran tests."""
    if all(c == NO_TESTS for c in codes) or (NO_TESTS in codes and not filtered):
        return NO_TESTS
    return next((c for c in codes if c not in (0, NO_TESTS)), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
