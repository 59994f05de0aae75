"""How an engine process knows its owner still runs: a process's identity (pid and start time) and
a watchdog that exits the engine once the owner is gone.

The engine server runs this (``--owner-pid``); the launcher side (parent-death signal, registry,
reaper) is relax.services.launchers.lifetime, which uses the same identity to never mistake a
reused pid for the process it recorded.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def start_time(pid: int) -> str | None:
    """An opaque start-time token of process ``pid`` (clock ticks since boot, from /proc), or
    None if no such process runs (a zombie counts as gone). Without /proc: "" while it exists."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    except OSError:  # no /proc (macOS): existence is all there is to check
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return ""
    fields = stat[stat.rindex(")") + 2:].split()  # the name may hold spaces and parentheses
    return None if fields[0] in ("Z", "X") else fields[19]


def is_running(pid: int, started: str | None) -> bool:
    """True while the process ``pid`` that started at ``started`` runs (not a reuse of its pid)."""
    now = start_time(pid)
    return now is not None and (started in (None, "") or now in ("", started))


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def watch_owner(pid: int, started: str | None, interval_s: float = 0.5,
                on_gone: Callable[[], None] | None = None) -> threading.Thread:
    """A daemon thread that calls ``on_gone`` (default: exit this process at once) when the
    owner ``pid`` that started at ``started`` no longer runs."""
    def gone() -> None:
        print(f"relax engine: owner process {pid} is gone; exiting", file=sys.stderr, flush=True)
        os._exit(0)

    def watch() -> None:
        while is_running(pid, started):
            time.sleep(interval_s)
        (on_gone or gone)()

    thread = threading.Thread(target=watch, name="relax-owner-watchdog", daemon=True)
    thread.start()
    return thread
