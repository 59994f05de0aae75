"""One attempt of one role placed by Ray: the disaggregated controller's roles on a Ray cluster.

On a cluster a role group (tasks/train.py) is one Ray cluster, and its controller runs in the
Flyte pod that drives it. Ray decides where each role runs (the node with its GPUs); there a
small actor, :class:`RoleHost`, starts the role as the same OS process a local run starts
(:class:`~relax.services.launchers.role_process.RoleProcess`: its log, its error file, the
SIGUSR1 stack dump of a hung role). :class:`RayRole` is the controller's handle on it, with
RoleProcess's interface, so ``run_disaggregated`` heals a role on a cluster exactly as it heals
a local one: same supervisor, backoff, restart log and ``relax status`` counts.

A host whose node (or Ray worker) died answers no call: the role counts as failed with
"its Ray actor died", and its restart gets a new host, which Ray may place on another node.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

from relax.config import config_from_dict, config_to_dict
from relax.faults import FAULT_ENV
from relax.services.launchers.lifetime import owned_temp_dir
from relax.services.launchers.role_process import RoleProcess
from relax.services.run_context import RunContext
from relax.services.supervision import RoleFailure

FORWARDED = (FAULT_ENV,)  # variables the controller's roles inherit, as local role processes do
CALL_TIMEOUT_S = 60.0  # a live host answers in milliseconds; a call that waits this long counts as a death


class RoleHost:
    """Runs on the node Ray chose: holds one role process at a time (a Ray actor class)."""

    def __init__(self, cfg: dict[str, Any], run_url: str, env: dict[str, str]):
        os.environ.update(env)  # what a local controller's roles inherit from it (FORWARDED)
        self.cfg = config_from_dict(cfg)
        self.run_url = run_url
        self.tmp = owned_temp_dir("relax-roles-")
        self.cfg_path = os.path.join(self.tmp, "config.json")
        with open(self.cfg_path, "w") as f:
            json.dump(cfg, f)
        self.proc: RoleProcess | None = None

    def start(self, role: str, attempt: int) -> float:
        self.proc = RoleProcess(role, self.cfg_path, self.run_url, attempt, self.tmp, self.cfg.supervisor)
        return self.proc.started_at

    def poll(self) -> tuple[int | None, bool]:
        return self.proc.returncode, self.proc.failed

    def kill_hung(self, idle_s: float) -> None:
        self.proc.kill_hung(idle_s)

    def finish(self) -> RoleFailure | None:
        return self.proc.finish()

    def kill(self) -> None:
        self.proc.kill()


class RayRole:
    """The controller's handle on role ``role``'s ``attempt``-th start on a :class:`RoleHost`."""

    def __init__(self, host: Any, role: str, attempt: int):
        import ray

        self.host, self.role, self.attempt = host, role, attempt
        self._lost: str | None = None
        self._final: tuple[int | None, bool] | None = None
        try:
            self.started_at = ray.get(host.start.remote(role, attempt), timeout=CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - a host that cannot start the role: a failed attempt
            self.started_at = time.time()
            unplaced = isinstance(e, ray.exceptions.GetTimeoutError)
            self._lose(e, f"its Ray actor was not placed or did not start within {CALL_TIMEOUT_S:.0f} s: the "
                          f"cluster may have no node with the CPUs and GPUs it asks for ({e})" if unplaced else None)

    def _lose(self, error: BaseException, why: str | None = None) -> None:
        self._lost = why or f"{type(error).__name__}: {error}"
        self._final = (-9, True)

    def _call(self, name: str, *args: Any) -> Any:
        import ray

        if self._lost is not None:
            return None
        try:
            return ray.get(getattr(self.host, name).remote(*args), timeout=CALL_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - RayActorError, a lost node, a timeout: all mean it is gone
            self._lose(e)
            return None

    def _poll(self) -> tuple[int | None, bool]:
        if self._final is not None:
            return self._final
        state = self._call("poll")
        if state is None:
            return self._final
        if state[0] is not None:
            self._final = state
        return state

    @property
    def returncode(self) -> int | None:
        return self._poll()[0]

    @property
    def failed(self) -> bool:
        return self._poll()[1]

    def kill_hung(self, idle_s: float) -> None:
        self._call("kill_hung", idle_s)  # the host's RoleProcess records the hang for its finish()

    def finish(self) -> RoleFailure | None:
        failure = self._call("finish")
        if self._lost is not None:
            return RoleFailure(
                self.role,
                self.attempt,
                "its Ray actor was lost (a lost node or worker, or never placed)",
                self._lost,
                "(on the lost node; the run's logs/ folder has what it uploaded)",
            )
        return failure

    def kill(self) -> None:
        self._call("kill")


def ray_role_starter(ctx: RunContext, gpus: Callable[[str], float], cpus: float = 1.0) -> Callable[[str, int], RayRole]:
    """``start(role, attempt)`` for ``run_disaggregated`` on the current Ray cluster: one host per role,
    asking Ray for ``cpus`` CPUs and ``gpus(role)`` GPUs, replaced when it died."""
    import ray

    remote = ray.remote(RoleHost)
    cfg = config_to_dict(ctx.cfg)
    env = {k: os.environ[k] for k in FORWARDED if k in os.environ}
    hosts: dict[str, Any] = {}

    def start(role: str, attempt: int) -> RayRole:
        host = hosts.get(role)
        if host is None or attempt > 0:
            if host is not None:
                ray.kill(host)  # a restart gets a fresh host: the old one's node may be the cause
            host = remote.options(num_cpus=cpus, num_gpus=gpus(role), name=f"relax-{role}-{attempt}",
                                  max_restarts=0).remote(cfg, ctx.run_url, env)
            hosts[role] = host
        return RayRole(host, role, attempt)

    return start
