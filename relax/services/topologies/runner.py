"""One role's loop in this process until the run's last step: what a disaggregated role process
(``relax role NAME CONFIG``) and an ``async`` Serve replica run."""

from __future__ import annotations

from typing import Any

import torch

from relax import liveness
from relax.config import RelaxConfig
from relax.faults import fault_point, set_attempt
from relax.services.heartbeat import HeartbeatWriter
from relax.services.report.metrics import RoleLogs
from relax.services.roles.factory import make_role, role_done, role_threads
from relax.services.run_context import RunContext


def run_role(role: str, cfg: RelaxConfig, timeout_s: float = 600.0, engine_urls: list[str] | None = None,
             on_step: Any = None, on_start: Any = None, api_mode: str = "thread", attempt: int = 0) -> int:
    """Step role ``role`` until it has done its part of the run; returns steps done.
    ``on_start(role_object)`` once it is built, ``on_step(metrics)`` after each step; ``attempt``:
    0 for the role's first start under its controller, k for its k-th restart (in its metrics)."""
    torch.set_num_threads(role_threads(role, cfg))
    set_attempt(attempt)
    ctx = RunContext(cfg)
    beat = HeartbeatWriter(ctx.run_url, role, attempt, cfg.supervisor.heartbeat_s)  # building counts too
    try:
        obj = make_role(role, ctx, engine_urls=engine_urls, wait_s=timeout_s, api_mode=api_mode)
    except BaseException:
        beat.stop()
        raise
    if on_start is not None:
        on_start(obj)
    log = RoleLogs(ctx.run_url)
    done = 0
    try:
        fault_point(role, "start")
        while not role_done(role, obj, cfg.trainer.total_steps):
            liveness.mark(liveness.WORKING)
            m = {**obj.step(timeout=timeout_s), "attempt": attempt}
            liveness.mark(liveness.WORKING, m.get("step", m.get("batch")))
            log.append(m)
            if on_step is not None:
                on_step(m)
            done += 1
            fault_point(role, "step", m.get("step", m.get("batch")))
    finally:
        beat.stop()
        obj.close()
    return done
