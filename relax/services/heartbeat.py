"""Role heartbeats on the run root, and the watch that finds a role that stopped making progress.

A role process publishes its last progress mark (relax.liveness) to
``runs/<id>/heartbeats/<role>.json`` every ``supervisor.heartbeat_s`` from a thread of its own.
The record names the attempt, the process, the state (waiting for input, working) and the
wall-clock time of the last mark. A frozen process stops publishing, and a stuck main thread
stops marking: either way the mark ages, so one number tells both apart from a healthy role.

The controller's :class:`HangWatch` reads those records and reports a role whose mark is older
than ``supervisor.hang_timeout_s``; the controller then kills the role and restarts it like one
that died ("no progress for N s"). Before a role's first heartbeat its start counts as its last
progress, so a role that hangs while it starts is caught too.
"""

from __future__ import annotations

import json
import math
import os
import socket
import threading
import time
from typing import Any

from relax import liveness, objstore
from relax.services.report.metrics import ROLES


def heartbeat_url(run_url: str, role: str) -> str:
    if role not in ROLES:  # the name becomes part of a path: only the roles Relax knows
        raise ValueError(f"no role {role!r}; roles are {', '.join(ROLES)}")
    return objstore.join(run_url, "heartbeats", f"{role}.json")


class HeartbeatWriter:
    """Publishes this process's progress mark for ``role`` every ``interval_s`` until :meth:`stop`."""

    def __init__(self, run_url: str, role: str, attempt: int, interval_s: float):
        self.url = heartbeat_url(run_url, role)
        self.role, self.attempt, self.interval_s = role, attempt, interval_s
        self._stop = threading.Event()
        liveness.reset()
        self.write()  # the start is the first progress the supervisor sees
        self._thread = threading.Thread(target=self._loop, name=f"relax-heartbeat-{role}", daemon=True)
        self._thread.start()

    def write(self) -> None:
        m = liveness.last()
        body = {"role": self.role, "attempt": self.attempt, "pid": os.getpid(), "host": socket.gethostname(),
                "state": m.state, "progress_at": m.at, "step": m.step, "max_gap_s": round(m.max_gap_s, 3),
                "written_at": time.time()}
        objstore.write_bytes(self.url, json.dumps(body).encode(), fsync=False)

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.write()
            except OSError:  # a store hiccup: the next beat tries again; a long outage shows as a stale mark
                pass

    def stop(self) -> None:
        """No more beats; the last one carries the role's final mark (``relax status`` shows it)."""
        self._stop.set()
        self._thread.join(timeout=self.interval_s + 5)
        try:
            self.write()
        except OSError:
            pass


def read_heartbeat(run_url: str, role: str) -> dict[str, Any] | None:
    """``role``'s last heartbeat, or None when there is none or it is not one this code wrote."""
    try:
        body = json.loads(objstore.read_bytes(heartbeat_url(run_url, role)))
    except (FileNotFoundError, ValueError, UnicodeDecodeError):
        return None
    ok = (isinstance(body, dict) and body.get("role") == role and isinstance(body.get("attempt"), int)
          and all(isinstance(body.get(k), (int, float)) and math.isfinite(body[k])
                  for k in ("progress_at", "written_at")))
    return body if ok else None


class HangWatch:
    """Which of a controller's roles made no progress for ``timeout_s`` (0 = never look).

    Reads a role's heartbeat at most every ``check_s``, so a poll loop may call :meth:`stalled`
    as often as it likes (on S3 each read is a request)."""

    def __init__(self, run_url: str, timeout_s: float, check_s: float):
        self.run_url, self.timeout_s, self.check_s = run_url, timeout_s, check_s
        self._read: dict[str, tuple[float, dict[str, Any] | None]] = {}  # role -> (monotonic read time, beat)

    def stalled(self, role: str, attempt: int, started_at: float, now: float | None = None) -> float | None:
        """Seconds since ``role``'s attempt ``attempt`` (started at wall time ``started_at``) last made
        progress, when that is more than the timeout; else None."""
        if self.timeout_s <= 0:
            return None
        at, beat = self._read.get(role, (-math.inf, None))
        if time.monotonic() - at >= self.check_s:
            beat = read_heartbeat(self.run_url, role)
            self._read[role] = (time.monotonic(), beat)
        last = started_at
        if beat is not None and beat["attempt"] == attempt:  # an earlier attempt's beat says nothing of this one
            last = max(last, float(beat["progress_at"]))
        idle = (time.time() if now is None else now) - last
        return idle if idle > self.timeout_s else None

    def forget(self, role: str) -> None:
        """The role was restarted: read its next heartbeat fresh."""
        self._read.pop(role, None)


def last_progress(run_url: str, role: str, now: float | None = None) -> dict[str, Any] | None:
    """What ``relax status`` shows of a role's liveness: attempt, state, step, seconds since progress."""
    beat = read_heartbeat(run_url, role)
    if beat is None:
        return None
    now = time.time() if now is None else now
    return {"attempt": beat["attempt"], "state": beat.get("state"), "step": beat.get("step"),
            "progress_s": round(now - beat["progress_at"], 1), "heartbeat_s": round(now - beat["written_at"], 1),
            "max_gap_s": beat.get("max_gap_s")}


HUNG_EXIT = 75  # a colocated process that ends itself for making no progress (EX_TEMPFAIL: try again)


class SelfWatch:
    """The colocated topology's watchdog: every role shares this process, so no controller outside
    it can restart one that is stuck. Past ``timeout_s`` without progress it prints every thread's
    stack and the reason, and ends the process with :data:`HUNG_EXIT`, so that what runs it (a Flyte
    task's retries, a shell loop, a scheduler) starts it again; the run resumes from the queue and
    its checkpoint as any rerun does."""

    def __init__(self, timeout_s: float, check_s: float):
        self.timeout_s, self.check_s = timeout_s, check_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if timeout_s > 0:
            liveness.reset()
            self._thread = threading.Thread(target=self._loop, name="relax-self-watch", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        import faulthandler
        import sys

        while not self._stop.wait(self.check_s):
            idle = time.time() - liveness.last().at
            if idle > self.timeout_s:
                print(f"relax: no progress for {idle:.0f} s (supervisor.hang_timeout_s={self.timeout_s:g}); "
                      f"every thread's stack follows. Exiting with {HUNG_EXIT}: run the same command again "
                      f"to resume from the queue and the last checkpoint.", file=sys.stderr, flush=True)
                faulthandler.dump_traceback(all_threads=True)
                os._exit(HUNG_EXIT)

    def stop(self) -> None:
        self._stop.set()
