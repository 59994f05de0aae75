"""One role's loop in this process until the run's last step: what a disaggregated role process
(``relax role NAME CONFIG``) and an ``async`` Serve replica run."""

from __future__ import annotations

from typing import Any

import torch

from relax.config import RelaxConfig
from relax.services.context import RunContext
from relax.services.report.metrics import RoleLogs
from relax.services.roles.factory import make_role, role_done, role_threads


def run_role(role: str, cfg: RelaxConfig, timeout_s: float = 600.0, engine_urls: list[str] | None = None,
             on_step: Any = None, on_start: Any = None, api_mode: str = "thread") -> int:
    """Step role ``role`` until it has done its part of the run; returns steps done.
    ``on_start(role_object)`` once it is built, ``on_step(metrics)`` after each step."""
    torch.set_num_threads(role_threads(role, cfg))
    ctx = RunContext(cfg)
    obj = make_role(role, ctx, engine_urls=engine_urls, wait_s=timeout_s, api_mode=api_mode)
    if on_start is not None:
        on_start(obj)
    log = RoleLogs(ctx.run_url)
    done = 0
    try:
        while not role_done(role, obj, cfg.trainer.total_steps):
            m = obj.step(timeout=timeout_s)
            log.append(m)
            if on_step is not None:
                on_step(m)
            done += 1
    finally:
        obj.close()
    return done
