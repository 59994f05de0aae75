"""Each role attempt's full log under the run root, and the role's last exception out of it.

``runs/<id>/logs/<role>/<attempt>.log``: attempts are numbered over the run's life (a rerun's
first attempt follows the last one's), so no log of an earlier failure is ever overwritten. A
file rotates past ``supervisor.log_max_mb`` into ``<attempt>.log.1`` (the newest) up to
``log_backups`` files. On a local root the file is written in place; on an object store it is
written in the controller's staging folder and uploaded when the attempt ends (a controller
that is SIGKILLed loses that attempt's log: the run's data is safe either way).

A role process writes its fatal exception to ``RELAX_ROLE_ERROR_FILE`` as it exits
(:func:`write_role_error`), so the controller quotes the traceback that ended it, not the tail
of a log that may end in another thread's noise; without one (a SIGKILL) it quotes the last
traceback in the log, if any (:func:`last_traceback`).
"""

from __future__ import annotations

import os
import re
import threading
from typing import IO

from relax import objstore

ERROR_FILE_ENV = "RELAX_ROLE_ERROR_FILE"
_ATTEMPT = re.compile(r"^(\d+)\.log$")
_TRACEBACK = "Traceback (most recent call last):"


def logs_url(run_url: str, role: str) -> str:
    return objstore.join(run_url, "logs", role)


def next_attempt(run_url: str, role: str) -> int:
    """The number of a new attempt of ``role``: one past every log the run has."""
    numbers = [int(m.group(1)) for n in objstore.list_dir(logs_url(run_url, role)) if (m := _ATTEMPT.match(n))]
    return max(numbers, default=-1) + 1


class RoleLogFile:
    """One attempt's log, written from a child's output by :meth:`pump` (one thread per file)."""

    def __init__(self, run_url: str, role: str, attempt: int, staging_dir: str, max_bytes: int, backups: int):
        self.url = objstore.join(logs_url(run_url, role), f"{attempt}.log")
        local = objstore.local_path(self.url)
        self.staged = local is None
        self.path = os.path.join(staging_dir, "logs", role, f"{attempt}.log") if self.staged else local
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        self.max_bytes, self.backups = max_bytes, backups
        self._file: IO[bytes] = open(self.path, "ab")
        self._lock = threading.Lock()

    @property
    def where(self) -> str:
        """What an error message names: the local path when there is one, else the URL."""
        return self.url if self.staged else self.path

    def write(self, data: bytes) -> None:
        with self._lock:
            if self._file.tell() + len(data) > self.max_bytes and self._file.tell() > 0:
                self._rotate()
            self._file.write(data)
            self._file.flush()

    def _rotate(self) -> None:
        self._file.close()
        if self.backups == 0:
            os.remove(self.path)
        else:
            for i in range(self.backups - 1, 0, -1):
                if os.path.exists(f"{self.path}.{i}"):
                    os.replace(f"{self.path}.{i}", f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        self._file = open(self.path, "ab")

    def pump(self, stream: IO[bytes]) -> threading.Thread:
        """Copy ``stream`` (a child's merged stdout/stderr) into the file until it closes."""
        def copy() -> None:
            for chunk in iter(lambda: stream.read1(65536), b""):
                self.write(chunk)
            stream.close()

        t = threading.Thread(target=copy, name=f"relax-log-{os.path.basename(self.path)}", daemon=True)
        t.start()
        return t

    def files(self) -> list[str]:
        """The attempt's local files, newest first."""
        return [p for p in [self.path] + [f"{self.path}.{i}" for i in range(1, self.backups + 1)]
                if os.path.exists(p)]

    def close(self) -> None:
        """Close the file; on an object-store root upload it (and its rotated files) to the run."""
        with self._lock:
            self._file.close()
        if self.staged:
            for path in self.files():
                with open(path, "rb") as f:
                    objstore.write_bytes(self.url + path[len(self.path):], f.read())


def last_traceback(text: str, limit: int = 6000) -> str | None:
    """The last Python traceback in ``text`` (to its end), at most ``limit`` characters from its end."""
    at = text.rfind(_TRACEBACK)
    if at < 0:
        return None
    block = text[at:].rstrip()
    return block if len(block) <= limit else "...\n" + block[-limit:]


def write_role_error(text: str) -> None:
    """In a role process that is failing: leave its traceback where its controller looks."""
    path = os.environ.get(ERROR_FILE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(text)


def role_error(error_file: str, log: RoleLogFile) -> str:
    """The failed attempt's last exception: the one it reported, else the last one in its log."""
    try:
        with open(error_file) as f:
            reported = f.read()
        if reported.strip():
            return reported
    except OSError:
        pass
    last_line = ""
    for path in log.files():
        with open(path, errors="replace") as f:
            text = f.read()
        found = last_traceback(text)
        if found:
            return f"(the role reported no error; the last traceback in its log)\n{found}"
        last_line = last_line or next((ln for ln in reversed(text.splitlines()) if ln.strip()), "")
    said = f"; the log's last line: {last_line[:500]}" if last_line else ""
    return f"(no Python traceback: the process was killed from outside, e.g. SIGKILL or out of memory{said})"
