"""The ``disaggregated`` topology: each role is its own OS process (``relax role NAME CONFIG``).

The processes share nothing but the run root (a folder or a bucket); on a cluster each is a
Flyte Ray task. This driver starts them, follows the actor's metrics into the progress bar,
and fails the run with the log tail of the first role that exits non-zero.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from relax.config_loader import config_to_dict
from relax.services.context import RunContext
from relax.services.launchers.process import kill_on_parent_death
from relax.services.report.metrics import MetricsReader
from relax.services.roles.factory import role_names
from relax.services.topologies.progress import Progress


def role_command(role: str, cfg_path: str) -> list[str]:
    return [sys.executable, "-m", "relax.cli.main", "role", role, cfg_path]


def run_disaggregated(ctx: RunContext, progress: bool = True) -> None:
    """Start every role of the run as a separate process and wait for all of them."""
    with tempfile.TemporaryDirectory(prefix="relax-roles-") as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(ctx.cfg), f)
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        # stderr to files, not pipes: a long run's warnings would fill a pipe nobody reads and block the role
        logs = {role: os.path.join(tmp, f"{role}.log") for role in role_names(ctx.cfg)}
        # this thread waits for the roles, so they die with it: a killed driver (Ctrl-C'd or SIGKILLed
        # `make run`, a Ray task whose owner died) leaves no role writing to the run it will resume
        procs = {role: subprocess.Popen(role_command(role, cfg_path), env=env, stdout=subprocess.DEVNULL,
                                        stderr=open(logs[role], "wb"), preexec_fn=kill_on_parent_death)
                 for role in logs}
        bar = Progress(ctx.cfg.trainer.total_steps, 0, progress)
        actor = MetricsReader(ctx.run_url, "actor")
        try:
            while True:
                running = [p for p in procs.values() if p.poll() is None]
                failed = [r for r, p in procs.items() if p.returncode not in (None, 0)]
                if failed:
                    with open(logs[failed[0]], errors="replace") as f:
                        tail = f.read()[-2000:]
                    raise RuntimeError(f"role {failed[0]} exited with {procs[failed[0]].returncode}: {tail}")
                for m in actor.new():
                    bar.actor(m)
                if not running:
                    break
                time.sleep(0.5)
        finally:
            for p in procs.values():
                if p.poll() is None:
                    p.kill()
                    p.wait()
            bar.close()
