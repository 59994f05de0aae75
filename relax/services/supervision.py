"""The controller's supervisor: restart a role that died, stop the run when a fault repeats.

Every topology's controller asks one :class:`RestartPolicy` what to do when a role fails: wait
``backoff_s * 2**(k-1)`` (capped at ``backoff_max_s``) before the k-th restart within
``restart_window_s``, or stop the run once a role has failed more than ``max_restarts`` times
in the window (:class:`RunStopped`, naming the role, its exit, its last exception and its log
file). A restarted role resumes exactly as a rerun would: from the queue's records and its
newest checkpoint (docs/runtime.md, "Fault recovery"), so a heal changes nothing the run computes.

Restarts are recorded under ``<run>/supervisor/<controller incarnation>/`` (one writer per
controller, like every log in Relax): ``relax status`` counts them per role and the actor's
lineage records carry the counts (:func:`read_restarts`).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relax import objstore
from relax.config import ConfigError, SupervisorConfig
from relax.data.errors import DataError
from relax.transfer.writers import RecordLog, new_incarnation, read_records

NOT_HEALED = (ConfigError, DataError)  # a user's error that every restart would repeat: the run stops at once


@dataclass
class RoleFailure:
    """One role's death as the controller saw it."""

    role: str
    attempt: int  # 0 = the role's first start under this controller, 1 = its first restart, ...
    exit: str  # "exit code 1", "signal 9 (SIGKILL)", "exception"
    error: str  # the role's last exception (a traceback), or why there is none
    log: str  # where the role's full log is
    healable: bool = True  # False: a user's error (bad config or data) that every restart would repeat

    def describe(self) -> str:
        return (f"role {self.role} (attempt {self.attempt}) failed with {self.exit}; full log: {self.log}\n"
                f"its last error:\n{self.error.rstrip()}")


class RunStopped(RuntimeError):
    """A role failed more often than ``supervisor.max_restarts`` allows: the run stops."""

    def __init__(self, failure: RoleFailure, failures: int, cfg: SupervisorConfig):
        self.failure = failure
        if not failure.healable:
            super().__init__(f"run stopped: role {failure.role} failed with an error a restart would repeat "
                             f"({failure.exit}); full log: {failure.log}\n{failure.error.rstrip()}")
            return
        super().__init__(
            f"run stopped: role {failure.role} failed {failures} times within {cfg.restart_window_s:.0f} s "
            f"(supervisor.max_restarts={cfg.max_restarts}); the last failure was {failure.exit}, full log: "
            f"{failure.log}\n{failure.error.rstrip()}\nFix the cause and run the same command again to resume; "
            f"raise supervisor.max_restarts to tolerate more failures.")


class RestartPolicy:
    """Per-role failure counting over a sliding window; ``clock`` is injectable for tests."""

    def __init__(self, cfg: SupervisorConfig, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.clock = cfg, clock
        self._failures: dict[str, list[float]] = {}
        self.restarts: dict[str, int] = {}  # restarts granted per role, for the controller's metrics

    def after_failure(self, failure: RoleFailure) -> float:
        """Seconds to wait before restarting ``failure.role``; raises :class:`RunStopped` past the limit."""
        now = self.clock()
        recent = [t for t in self._failures.get(failure.role, []) if now - t < self.cfg.restart_window_s] + [now]
        self._failures[failure.role] = recent
        if len(recent) > self.cfg.max_restarts or not failure.healable:
            raise RunStopped(failure, len(recent), self.cfg)
        self.restarts[failure.role] = self.restarts.get(failure.role, 0) + 1
        return min(self.cfg.backoff_max_s, self.cfg.backoff_s * 2 ** (len(recent) - 1))


def _supervisor_url(run_url: str) -> str:
    return objstore.join(run_url, "supervisor")


class RestartLog:
    """The restarts one controller granted, as records of its own log."""

    def __init__(self, run_url: str):
        self.log = RecordLog(objstore.join(_supervisor_url(run_url), new_incarnation()))

    def record(self, failure: RoleFailure, delay_s: float) -> None:
        last_line = failure.error.strip().splitlines()[-1:] or [""]
        self.log.append({"time": time.time(), "role": failure.role, "attempt": failure.attempt,
                         "exit": failure.exit, "error": last_line[0][:500], "log": failure.log,
                         "restart_in_s": round(delay_s, 3)})


class Supervisor:
    """What a controller calls when one of its roles failed: the policy's verdict, the restart
    recorded in the run, and a line for the user (``notify``, stderr by default)."""

    def __init__(self, run_url: str, cfg: SupervisorConfig, notify: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.run_url, self.cfg = run_url, cfg
        self.policy = RestartPolicy(cfg, clock)
        self.notify = notify or (lambda text: print(text, file=sys.stderr, flush=True))
        self._log: RestartLog | None = None

    def failed(self, failure: RoleFailure) -> float:
        """Seconds to wait before restarting the role; raises :class:`RunStopped` past the limit."""
        delay = self.policy.after_failure(failure)
        if self._log is None:  # a run that never heals writes no restart log
            self._log = RestartLog(self.run_url)
        self._log.record(failure, delay)
        error = failure.error.strip().splitlines()[-1:] or [""]
        self.notify(f"relax: role {failure.role} failed ({failure.exit}: {error[0][:300]}); restarting it in "
                    f"{delay:.1f} s (restart {self.policy.restarts[failure.role]}, at most {self.cfg.max_restarts} "
                    f"within {self.cfg.restart_window_s:.0f} s); full log: {failure.log}")
        return delay


def restart_events(run_url: str) -> list[dict[str, Any]]:
    """Every restart of the run (all controller incarnations), oldest first."""
    base = _supervisor_url(run_url)
    events = [r for inc in objstore.list_dir(base) for _, r in read_records(objstore.join(base, inc))]
    return sorted(events, key=lambda r: r["time"])


def read_restarts(run_url: str) -> dict[str, int]:
    """Restarts per role over the run's life (roles never restarted are absent)."""
    out: dict[str, int] = {}
    for e in restart_events(run_url):
        out[e["role"]] = out.get(e["role"], 0) + 1
    return out
