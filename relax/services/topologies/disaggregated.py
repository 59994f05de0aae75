"""The ``disaggregated`` topology: each role is its own OS process (``relax role NAME CONFIG``).

The processes share nothing but the run root (a folder or a bucket); on a cluster each is a
Flyte Ray task. This controller starts them, follows the actor's metrics into the progress bar,
and heals the run: a role that dies is started again after a backoff and resumes from the
queue and its checkpoint, while the others carry on (relax.services.supervision); so is a role
that made no progress for ``supervisor.hang_timeout_s`` (relax.services.heartbeat). Only a
fault that repeats past ``supervisor.max_restarts`` stops the run, with the role's last
exception and the path of its full log (``runs/<id>/logs/<role>/<n>.log``).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Sequence

from relax.config import config_to_dict
from relax.services.heartbeat import HangWatch
from relax.services.launchers.lifetime import owned_temp_dir
from relax.services.launchers.role_process import RoleProcess
from relax.services.report.metrics import MetricsReader
from relax.services.roles.factory import role_names
from relax.services.run_context import RunContext
from relax.services.supervision import Supervisor
from relax.services.topologies.progress import Progress

Starter = Callable[[str, int], RoleProcess]  # (role, attempt) -> a started role with RoleProcess's interface


def run_disaggregated(ctx: RunContext, progress: bool = True, poll_s: float = 0.5,
                      roles: Sequence[str] | None = None, starter: Starter | None = None) -> dict[str, int]:
    """Run ``roles`` (default: every role of the run) as separate processes, restarting those that die,
    until all are done; returns each role's attempts. ``starter(role, attempt)`` starts one (default:
    an OS process here; relax.services.launchers.ray_role: one placed by Ray)."""
    tmp = owned_temp_dir("relax-roles-")  # also clears what a SIGKILLed controller left
    procs: dict[str, RoleProcess] = {}
    bar = Progress(ctx.cfg.trainer.total_steps, 0, progress)
    try:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump(config_to_dict(ctx.cfg), f)
        supervisor = Supervisor(ctx.run_url, ctx.cfg.supervisor, notify=bar.note)

        def start(role: str, attempt: int) -> RoleProcess:
            if starter is not None:
                return starter(role, attempt)
            return RoleProcess(role, cfg_path, ctx.run_url, attempt, tmp, ctx.cfg.supervisor)

        procs = {role: start(role, 0) for role in (role_names(ctx.cfg) if roles is None else roles)}
        due: dict[str, float] = {}  # role -> when its restart is due (monotonic)
        actor = MetricsReader(ctx.run_url, "actor")
        rollout = MetricsReader(ctx.run_url, "rollout")  # the reward on the progress line
        sup = ctx.cfg.supervisor
        hangs = HangWatch(ctx.run_url, sup.hang_timeout_s, check_s=max(poll_s, sup.heartbeat_s))
        while True:
            for role, p in procs.items():
                if role in due or p.returncode is not None:
                    continue
                idle = hangs.stalled(role, p.attempt, p.started_at)
                if idle is not None:  # frozen or stuck: healed like a death
                    p.kill_hung(idle)
                    hangs.forget(role)
            for role, p in procs.items():
                if role not in due and p.failed:
                    failure = p.finish()
                    due[role] = time.monotonic() + supervisor.failed(failure)  # raises past the limit
            for role, at in list(due.items()):
                if time.monotonic() >= at:
                    procs[role] = start(role, procs[role].attempt + 1)
                    del due[role]
            bar.follow(actor, rollout)
            if not due and all(p.returncode == 0 and not p.failed for p in procs.values()):
                break
            time.sleep(poll_s)
        for p in procs.values():
            p.finish()  # uploads the logs of an object-store root
        return {role: p.attempt + 1 for role, p in procs.items()}
    finally:
        for p in procs.values():
            p.kill()
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
