"""Starting native engine servers for the elastic rollout API.

``POST /rollout/scale_out {"num_replicas": n}`` asks a launcher for ``n`` new engines. The
launcher is a protocol so the same API can place engines as local processes (this module),
as Ray actors or on another scheduler; the API only needs each engine's URL and a way to
stop it. A launcher refuses a request it cannot satisfy as a whole (:class:`CapacityError`)
before starting anything, so a scale-out never leaves half its engines behind.

The rollout also launches its own engines here (``rollout.engine_processes``); the pool
(:class:`~relax.rollout.remote_engines.RemoteEngines`) then owns them and, when one dies, launches a
replacement through the same launcher (the dead one no longer counts against ``max_engines``).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path


class CapacityError(RuntimeError):
    """The launcher cannot start the requested engines; nothing was started."""


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kill_on_parent_death() -> None:
    """In the child before exec (Linux): SIGTERM when the spawning thread's process dies, so an
    engine or a role process never outlives a killed owner (a Ray actor, a Ray task, a driver).
    Only for owners that spawn from a thread that lives as long as they do: the signal follows
    the thread, not the process."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the owner's stop() is the only way out
        pass


class NativeEngineProcess:
    """``python -m relax.engines.server`` on a free loopback port, serving a local HF model folder.

    The constructor only spawns the process, so several can boot in parallel; call
    :meth:`wait_healthy` (or use :meth:`start`) before routing to it.
    """

    def __init__(self, model_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
                 max_batch_size: int = 16, weight_store_root: str | None = None, run_id: str | None = None,
                 log_dir: str | Path | None = None, seed: int = 0, die_with_parent: bool = False):
        self.host = host
        self.port = port or _free_port(host)
        args = [sys.executable, "-m", "relax.engines.server", "--model-path", str(model_dir), "--host", host,
                "--port", str(self.port), "--max-batch-size", str(max_batch_size), "--seed", str(seed)]
        if weight_store_root and run_id:
            args += ["--weight-store-root", weight_store_root, "--run-id", run_id]
        log = tempfile.NamedTemporaryFile(prefix=f"relax-engine-{self.port}-", suffix=".log",
                                          dir=log_dir, delete=False)
        self.log_path = Path(log.name)
        # One OpenMP thread per engine: several engines share the host's cores, and oversubscribed
        # thread pools make every engine slower than one thread each.
        env = {"OMP_NUM_THREADS": "1", **os.environ}
        with log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         preexec_fn=kill_on_parent_death if die_with_parent else None)

    @classmethod
    def start(cls, model_dir: str | Path, timeout_s: float = 180.0, **kwargs) -> NativeEngineProcess:
        engine = cls(model_dir, **kwargs)
        engine.wait_healthy(timeout_s)
        return engine

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_healthy(self, timeout_s: float = 180.0) -> None:
        """Return once ``GET /health`` answers 200; on exit or timeout stop it and raise with its log."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive:
                raise RuntimeError(f"engine server on port {self.port} exited with {self.proc.returncode} before "
                                   f"becoming healthy; last lines of {self.log_path}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"engine server {self.url} not healthy within {timeout_s:.0f} s (slow model "
                                   f"load? raise the timeout); last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate (the server shuts down cleanly), then kill if it does not exit in time."""
        if self.alive:
            self.proc.terminate()
            # a stopped (SIGSTOP, hung in a debugger) process handles the SIGTERM only once continued
            self.proc.send_signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)


class LocalProcessLauncher:
    """Native engines as subprocesses of this host, at most ``max_engines`` alive at once."""

    def __init__(self, model_dir: str | Path, max_engines: int, *, startup_timeout_s: float = 180.0,
                 **engine_kwargs):
        if max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines}")
        self.model_dir = str(model_dir)
        self.max_engines = max_engines
        self.startup_timeout_s = startup_timeout_s
        self.engine_kwargs = engine_kwargs
        self._engines: list[NativeEngineProcess] = []
        self._lock = threading.Lock()

    def running(self) -> list[NativeEngineProcess]:
        with self._lock:
            self._engines = [e for e in self._engines if e.alive]
            return list(self._engines)

    def launch(self, n: int) -> list[NativeEngineProcess]:
        if n < 1:
            raise ValueError(f"launch needs n >= 1, got {n}")
        with self._lock:  # reserve the slots before the slow start, so two launches cannot overshoot
            self._engines = [e for e in self._engines if e.alive]
            free = self.max_engines - len(self._engines)
            if n > free:
                raise CapacityError(f"cannot launch {n} native engine(s): {len(self._engines)} of max_engines="
                                    f"{self.max_engines} are running, so {free} more fit; ask for at most {free} "
                                    f"or scale in first")
            started = [NativeEngineProcess(self.model_dir, **self.engine_kwargs) for _ in range(n)]
            self._engines += started
        try:
            for e in started:
                e.wait_healthy(self.startup_timeout_s)
        except BaseException:
            for e in started:
                e.stop()
            raise
        return started

    def stop_all(self) -> None:
        for e in self.running():
            e.stop()
