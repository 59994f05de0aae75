"""Engine processes that die with the process that owns them, and a reaper for any that do not.

An engine server is only reachable through the pool of the process that started it, so once
that owner is gone (SIGKILLed, OOM-killed, crashed) the engine serves nobody and holds its
memory and cores until someone notices. Three mechanisms, because each has a hole:

1. **Parent-death signal** (Linux ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, set in the child
   by :func:`dying_with_owner` before the engine is exec'd): the kernel kills the engine as soon as its owner dies.
   The signal follows the *thread* that forked the child, not the process, so every owned
   engine is forked by one spawner thread that lives as long as the process (:func:`spawn`);
   forked from a short-lived worker thread, an engine would be killed when that thread ends.
   SIGKILL and not SIGTERM: a stopped (SIGSTOPped, hung in a debugger) engine never handles
   a SIGTERM.
2. **A watchdog on the owner** (:func:`watch_owner`, run by ``relax.engines.server
   --owner-pid``): covers engines launched through an intermediary (a shell, a Ray worker)
   whose parent is not the owner, and systems without prctl. It compares the owner's pid
   *and start time*, so a pid reused by an unrelated process does not keep an orphan alive.
3. **A registry and a reaper** (:func:`record`, :func:`reap_orphans`): every owned engine
   leads its own process group and is recorded in a small local folder (pid, start time, a
   token on its command line, its owner's pid and start time). Before a launcher starts
   engines it ends every recorded engine whose owner is gone, so a restarted rollout ends
   whatever its previous incarnation left before it starts new ones. It kills only a process
   whose start time and command-line token match the record: never an unrelated process
   that reused the number.

The registry is keyed by owner liveness, not by run: an engine whose owner is gone is an
orphan whatever run it served, and a launcher need not know its run to reap its own.
``RELAX_ENGINE_REGISTRY`` overrides the folder (default ``<tmp>/relax-engines-<uid>``).
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from relax.engines.owner import cmdline, is_running, start_time, watch_owner  # noqa: F401 - re-exported

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
REGISTRY_FLAG = "--registry-id"  # not a credential: what names an engine in its owner's registry


# -- dying with the owner --------------------------------------------------------------------------
# Run as ``python -c`` in the child: set the parent-death signal, check the owner did not die before
# it was set (the race prctl leaves open: the child would then have been reparented), then become the
# engine (execvp keeps the signal). Not a ``preexec_fn``: CPython runs its after-fork clean-up in the
# child before one, which frees the other threads' thread-locals there, and PyAV's per-thread frame
# reformatter, freed in a child whose threads are gone, waits forever for them (CI hung on it).
_DIE_WITH_OWNER = ("import ctypes, os, sys\n"
                   f"try:\n    ctypes.CDLL('libc.so.6').prctl({PR_SET_PDEATHSIG}, int(sys.argv[1]))\n"
                   "except (OSError, AttributeError):\n    pass\n"
                   "if os.getppid() != int(sys.argv[2]):\n    os._exit(1)\n"
                   "os.execvp(sys.argv[3], sys.argv[3:])\n")


def dying_with_owner(args: list[str], owner_pid: int, sig: int = signal.SIGKILL) -> list[str]:
    """``args`` started so that the process gets ``sig`` when the thread that forked it ends (Linux; the
    watchdog and the reaper remain elsewhere)."""
    if not sys.platform.startswith("linux"):
        return list(args)
    return [sys.executable, "-c", _DIE_WITH_OWNER, str(int(sig)), str(owner_pid), *args]


class _Spawner:
    """One thread per process that forks every owned engine (see the module docstring, 1)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._pid = -1

    def popen(self, args: list[str], **kwargs: Any) -> subprocess.Popen:
        job: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._thread is None or self._pid != os.getpid():  # a forked child has no spawner thread
                self._jobs, self._pid = queue.SimpleQueue(), os.getpid()
                self._thread = threading.Thread(target=self._serve, args=(self._jobs,), daemon=True,
                                                name="relax-engine-spawner")
                self._thread.start()
            self._jobs.put((job, args, kwargs))
        return job.result()

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:  # never returns: its end would signal every engine it forked
            job, args, kwargs = jobs.get()
            try:
                job.set_result(subprocess.Popen(args, **kwargs))
            except BaseException as e:
                job.set_exception(e)


_SPAWNER = _Spawner()


def spawn(args: list[str], **popen_kwargs: Any) -> subprocess.Popen:
    """``subprocess.Popen(args, **popen_kwargs)`` on the process's long-lived spawner thread."""
    return _SPAWNER.popen(args, **popen_kwargs)


# -- the registry of owned engines -----------------------------------------------------------------
def registry_dir() -> Path:
    folder = os.environ.get("RELAX_ENGINE_REGISTRY")
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(folder) if folder else Path(tempfile.gettempdir()) / f"relax-engines-{uid}"


def record(pid: int, token: str, owner_pid: int, **info: Any) -> Path | None:
    """Note an engine this process owns; None (and a warning) if the folder is not writable."""
    folder = registry_dir()
    entry = {"pid": pid, "start": start_time(pid), "token": token, "owner_pid": owner_pid,
             "owner_start": start_time(owner_pid), **info}
    path = folder / f"{pid}-{token}.json"
    try:
        for tries_left in (2, 1, 0):  # forget() of another owner may remove the folder as it empties
            try:
                folder.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(entry))
                os.replace(tmp, path)
                break
            except FileNotFoundError:
                if not tries_left:
                    raise
    except OSError as e:  # the parent-death signal and the watchdog still apply
        log.warning("could not record engine %s in %s (%s); a restart cannot reap it if it outlives its owner",
                    pid, folder, e)
        return None
    return path


def forget(pid: int, token: str) -> None:
    (registry_dir() / f"{pid}-{token}.json").unlink(missing_ok=True)
    try:  # the last engine gone: no folder left behind in the temp dir
        registry_dir().rmdir()
    except OSError:  # not empty (other engines), or gone
        pass


# -- temporary folders that outlive a killed owner -------------------------------------------------
_OWNED_TMP = re.compile(r"^(relax-[a-z-]+-)(\d+)\.(\d*)-")
SWEPT_PREFIXES = ("relax-roles-", "relax-engine-model-", "relax-judge-model-")


def owned_temp_dir(prefix: str) -> str:
    """``tempfile.mkdtemp`` named for this process (``<prefix><pid>.<start>-XXXX``): its owner
    removes it on a clean exit, and the next process that makes one (:func:`sweep_temp_dirs`,
    first) once the owner is gone (SIGKILLed), whatever topology either ran in."""
    if prefix not in SWEPT_PREFIXES:
        raise ValueError(f"temp dir prefix {prefix!r} is not swept; use one of {SWEPT_PREFIXES}")
    sweep_temp_dirs()
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}.{start_time(os.getpid()) or ''}-")


def sweep_temp_dirs() -> list[str]:
    """Remove the :func:`owned_temp_dir` folders whose owner no longer runs; returns them."""
    base = tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return []
    for name in names:
        m = _OWNED_TMP.match(name)
        if m and m.group(1) in SWEPT_PREFIXES and not is_running(int(m.group(2)), m.group(3)):
            shutil.rmtree(os.path.join(base, name), ignore_errors=True)
            removed.append(name)
    return removed


def _matches(entry: dict[str, Any]) -> bool:
    """The recorded engine itself runs: same pid, same start time, its token on its command line."""
    pid = int(entry["pid"])
    return is_running(pid, entry.get("start")) and entry["token"] in cmdline(pid)


def reap_orphans(timeout_s: float = 10.0) -> list[int]:
    """End every recorded engine whose owner is gone (with its process group) and drop the
    records of engines that exited; returns the pids killed. Engines of a running owner stay."""
    folder = registry_dir()
    try:
        paths = sorted(folder.glob("*.json"))
    except OSError:
        return []
    killed = []
    for path in paths:
        try:
            entry = json.loads(path.read_text())
            pid, owner = int(entry["pid"]), int(entry["owner_pid"])
        except (OSError, ValueError, KeyError, TypeError):
            continue  # being written, or not ours to judge
        if is_running(owner, entry.get("owner_start")):
            continue
        if _matches(entry):
            log.warning("ending engine process %s (%s) left by owner %s, which is gone", pid,
                        entry.get("url", "?"), owner)
            _kill_group(pid)
            killed.append(pid)
        path.unlink(missing_ok=True)
    deadline = time.monotonic() + timeout_s
    while any(start_time(p) is not None for p in killed) and time.monotonic() < deadline:
        time.sleep(0.05)
    return killed


def _kill_group(pid: int) -> None:
    """SIGKILL ``pid`` and, when it leads one (as owned engines do), its process group."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    except PermissionError as e:  # another user's process: the registry folder was shared
        log.warning("cannot end engine process %s: %s", pid, e)
