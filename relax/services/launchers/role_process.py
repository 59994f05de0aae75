"""One attempt of one role as an OS process (``relax role NAME CONFIG``), its output in its log.

The disaggregated controller starts one per role and a new one for each restart. The child's
stdout and stderr go through a pipe into the attempt's :class:`RoleLogFile` (a thread per
process reads it, so a chatty role never blocks on a full pipe, and the file rotates), and the
child writes its fatal exception to a file of its own as it fails, which :meth:`RoleProcess.finish`
turns into a :class:`RoleFailure`.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from relax.config import SupervisorConfig
from relax.faults import ATTEMPT_ENV
from relax.services.launchers.lifetime import dying_with_owner
from relax.services.report.role_logs import ERROR_FILE_ENV, RoleLogFile, next_attempt, role_error
from relax.services.supervision import RoleFailure

USAGE_EXIT = 2  # relax's exit status for a user's error (relax.cli.main): never healed by a restart


def role_command(role: str, cfg_path: str) -> list[str]:
    return [sys.executable, "-m", "relax.cli.main", "role", role, cfg_path]


def describe_exit(returncode: int) -> str:
    """``-9`` -> ``signal 9 (SIGKILL)``; ``1`` -> ``exit code 1``."""
    if returncode < 0:
        try:
            return f"signal {-returncode} ({signal.Signals(-returncode).name})"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


class RoleProcess:
    """Role ``role``'s ``attempt``-th start (0 = first) under this controller, logging to the run."""

    def __init__(self, role: str, cfg_path: str, run_url: str, attempt: int, staging_dir: str,
                 cfg: SupervisorConfig):
        self.role, self.attempt = role, attempt
        self.started_at = time.time()  # its progress until its first heartbeat (relax.services.heartbeat)
        self.hung_s: float | None = None  # set when the controller killed it for making no progress
        self.log = RoleLogFile(run_url, role, next_attempt(run_url, role), staging_dir,
                               max_bytes=int(cfg.log_max_mb * 2**20), backups=cfg.log_backups)
        self.error_file = os.path.join(staging_dir, f"{role}-{attempt}.error")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", ATTEMPT_ENV: str(attempt), ERROR_FILE_ENV: self.error_file}
        # this thread waits for the roles, so they die with it: a killed controller (Ctrl-C'd or SIGKILLed
        # `make run`, a Ray task whose owner died) leaves no role writing to the run it will resume
        self.proc = subprocess.Popen(dying_with_owner(role_command(role, cfg_path), os.getpid(), signal.SIGTERM),
                                     env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        self._pump = self.log.pump(self.proc.stdout)
        self._closed = False

    @property
    def returncode(self) -> int | None:
        return self.proc.poll()

    @property
    def failed(self) -> bool:
        """It exited non-zero, or the controller killed it as hung (whatever it exited with)."""
        rc = self.proc.poll()
        return rc is not None and (rc != 0 or self.hung_s is not None)

    def finish(self) -> RoleFailure | None:
        """After the process exited: close (and upload) its log; its failure, if it failed."""
        rc = self.proc.wait()
        if not self._closed:
            self._pump.join(timeout=10)  # the pipe closes with the process (and any child holding it)
            self.log.close()
            self._closed = True
        if self.hung_s is not None:  # even when it got to exit 0 in the moment it was continued
            return RoleFailure(self.role, self.attempt, f"no progress for {self.hung_s:.0f} s (hung; killed)",
                               _hung_error(self.log), self.log.where)
        if rc == 0:
            return None
        return RoleFailure(self.role, self.attempt, describe_exit(rc), role_error(self.error_file, self.log),
                           self.log.where, healable=rc != USAGE_EXIT)

    def kill_hung(self, idle_s: float, dump_wait_s: float = 10.0) -> None:
        """It made no progress for ``idle_s``: have it print every thread's stack to its log (a
        stopped process is continued for that), then kill it. :meth:`finish` names the hang."""
        self.hung_s = idle_s
        try:
            for sig in (signal.SIGUSR1, signal.SIGCONT):  # SIGUSR1: faulthandler in `relax role`
                self.proc.send_signal(sig)
            # until the stacks reach its log (on a loaded machine the continued process may wait for a
            # core, and the log's pump for another), or it exits, or dump_wait_s pass
            deadline = time.monotonic() + dump_wait_s
            while time.monotonic() < deadline and self.proc.poll() is None and not self._stacks_logged():
                time.sleep(0.05)
            time.sleep(0.2)  # the rest of the dump: faulthandler writes all threads at once
            self.proc.kill()
        except ProcessLookupError:
            pass

    def _stacks_logged(self) -> bool:
        return _last_dump(self.log) is not None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.finish()


_DUMP_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):", re.M)


def _last_dump(log) -> str | None:
    """The stack dump (faulthandler) at the end of the newest log file, from its first header."""
    files = log.files()
    if not files:
        return None
    try:
        with open(files[0], "rb") as f:
            f.seek(max(0, os.path.getsize(files[0]) - 20000))  # the dump is the last thing it wrote
            tail = f.read().decode(errors="replace")
    except OSError:
        return None
    found = _DUMP_HEADER.search(tail)
    return tail[found.start():][-6000:] if found else None


def _hung_error(log) -> str:
    """The stacks a hung role printed as it was killed, for its failure."""
    dump = _last_dump(log)
    return f"(its stacks as it was killed)\n{dump}" if dump else "(it printed no stacks: it did not answer SIGUSR1)"
