"""Starting native engine servers for the elastic rollout API.

``POST /rollout/scale_out {"num_replicas": n}`` asks a launcher for ``n`` new engines. The
launcher is a protocol so the same API can place engines as local processes (this module),
as Ray actors or on another scheduler; the API only needs each engine's URL and a way to
stop it. A launcher refuses a request it cannot satisfy as a whole (:class:`CapacityError`)
before starting anything, so a scale-out never leaves half its engines behind.

The rollout also launches its own engines here (``rollout.engine_processes``); the pool
(:class:`~relax.rollout.remote_engines.RemoteEngines`) then owns them and, when one dies, launches a
replacement through the same launcher (the dead one no longer counts against ``max_engines``).

Owned engines die with their owner however it dies, and a launcher ends any engine a previous
owner left behind before it starts new ones (``lifetime.py``). Every engine runs torch with
the same number of threads (``num_threads``), so every engine computes the same floats.
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
import uuid
from collections.abc import Callable
from pathlib import Path

from relax import liveness
from relax.engines.guards import TOKEN_ENV
from relax.faults import ATTEMPT_ENV, current_attempt
from relax.services.launchers import lifetime


class CapacityError(RuntimeError):
    """The launcher cannot start the requested engines; nothing was started."""


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class EngineStartFailed(RuntimeError):
    """An engine process exited before it answered ``/health``; ``killed``: by a signal (a SIGKILL,
    the OOM killer, a lost node), which a replacement may survive, rather than by an error of its
    own, which a replacement would repeat. The message quotes the cause: the engine's last Python
    traceback, or the signal, rather than whatever progress line it printed last."""

    def __init__(self, engine: EngineProcess):
        rc = engine.proc.returncode
        self.killed = rc is not None and rc < 0
        if self.killed:
            try:
                how = f"signal {-rc} ({signal.Signals(-rc).name})"
            except ValueError:
                how = f"signal {-rc}"
            cause = (f"was killed by {how} (out of memory, or killed from outside); its log's last line: "
                     f"{_last_line(engine.log_tail())}")
        else:
            found = _last_traceback(engine.log_tail(20_000))
            cause = (f"exited with code {rc}; its error:\n{found}" if found else
                     f"exited with code {rc} and printed no traceback; last lines of its log:\n{engine.log_tail()}")
        super().__init__(f"{engine.name} on port {engine.port} {cause}\n(full log: {engine.log_path})")


def _last_traceback(text: str) -> str:
    at = text.rfind("Traceback (most recent call last):")
    return text[at:].strip()[-4000:] if at >= 0 else ""


def _last_line(text: str) -> str:
    return next((ln.strip()[:300] for ln in reversed(text.splitlines()) if ln.strip()), "(empty)")


class EngineProcess:
    """An engine server process on a free loopback port: its log, health wait and stop.

    The constructor of a concrete engine (:class:`NativeEngineProcess`, an SGLang server) builds
    its command line and calls :meth:`_spawn`, which only spawns it, so several can boot in
    parallel; call :meth:`wait_healthy` before routing to it. ``owned`` (``die_with_parent``):
    it dies with this process (a parent-death signal) and leads its own process group, which
    :meth:`stop` ends whole (an engine's own children with it).
    """

    name = "engine server"
    host: str
    port: int

    def _spawn(self, args: list[str], env: dict[str, str], log_dir: str | Path | None, owned: bool,
               token: str | None = None) -> None:
        """Start ``args``; ``token`` (on its command line) records it for the reaper (``lifetime.py``)."""
        self.owned, self.token = owned, token
        owner = os.getpid()
        log = tempfile.NamedTemporaryFile(prefix=f"relax-engine-{self.port}-", suffix=".log",
                                          dir=log_dir, delete=False)
        self.log_path = Path(log.name)
        with log:
            # its own process group (session): stop() and a reaper end it with anything it started
            self.proc = lifetime.spawn(lifetime.dying_with_owner(args, owner) if owned else args, stdout=log,
                                       stderr=subprocess.STDOUT, env=env, start_new_session=True)
        if owned and token:
            lifetime.record(self.proc.pid, token, owner, url=self.url, log=str(self.log_path))

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
                raise EngineStartFailed(self)
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            liveness.mark(liveness.WAITING)  # its own deadline bounds this wait, not the hang watchdog
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(f"{self.name} {self.url} not healthy within {timeout_s:.0f} s (slow model "
                                   f"load? raise the timeout); last lines of {self.log_path}:\n{self.log_tail()}")
            time.sleep(0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Terminate its process group (the server exits at once), then kill it if it does not exit in time."""
        if self.alive:
            self._signal(signal.SIGTERM)
            # a stopped (SIGSTOP, hung in a debugger) process handles the SIGTERM only once continued
            self._signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait(timeout=timeout_s)
        if self.owned and self.token:
            lifetime.forget(self.proc.pid, self.token)

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)  # it leads its group (start_new_session)
        except ProcessLookupError:
            pass
        except PermissionError:  # a group we cannot signal as a whole (not expected): the process itself
            self.proc.send_signal(sig)


class NativeEngineProcess(EngineProcess):
    """``python -m relax.engines.server`` serving a local HF model folder (:class:`EngineProcess`).

    ``die_with_parent`` (the default): this process owns the engine. It dies with it (a
    parent-death signal, and a watchdog in the server on this pid), leads its own process group,
    and is recorded so that a later launcher can end it if it outlives this process anyway; any
    engine left by an owner that is gone is ended first (``lifetime.reap_orphans``).
    ``num_threads``: torch threads in the engine (default ``OMP_NUM_THREADS``, else 1): one
    value for every engine of a run, since a different thread count can change the floats.
    ``attempt``: what an injected engine fault counts (relax.faults).
    """

    def __init__(self, model_dir: str | Path, *, host: str = "127.0.0.1", port: int | None = None,
                 max_batch_size: int = 16, weight_store_root: str | None = None, run_id: str | None = None,
                 log_dir: str | Path | None = None, seed: int = 0, die_with_parent: bool = True,
                 num_threads: int | None = None, api_token: str | None = None, attempt: int = 0,
                 record_routes: bool = False):
        self.host = host
        self.port = port or free_port(host)
        self.num_threads = num_threads or default_num_threads()
        token = uuid.uuid4().hex
        owner = os.getpid()
        args = [sys.executable, "-m", "relax.engines.server", "--model-path", str(model_dir), "--host", host,
                "--port", str(self.port), "--max-batch-size", str(max_batch_size), "--seed", str(seed),
                "--num-threads", str(self.num_threads), lifetime.REGISTRY_FLAG, token]
        if weight_store_root and run_id:
            args += ["--weight-store-root", weight_store_root, "--run-id", run_id]
        if record_routes:  # algorithm.routing_replay: the engine returns each token's experts
            args.append("--enable-return-routed-experts")
        if die_with_parent:
            args += ["--owner-pid", str(owner), "--owner-start", lifetime.start_time(owner) or ""]
            lifetime.reap_orphans()
        # torch reads OMP_NUM_THREADS as it loads; the server also sets the count explicitly
        env = {**os.environ, "OMP_NUM_THREADS": str(self.num_threads)}
        env[ATTEMPT_ENV] = str(attempt)  # replacements count up: an injected engine fault can spare them
        if api_token:  # the engine's bearer token (relax.engines.guards); else whatever this process has
            env[TOKEN_ENV] = api_token
        self._spawn(args, env, log_dir, die_with_parent, token)

    @classmethod
    def start(cls, model_dir: str | Path, timeout_s: float = 180.0, **kwargs) -> NativeEngineProcess:
        engine = cls(model_dir, **kwargs)
        engine.wait_healthy(timeout_s)
        return engine


def default_num_threads() -> int:
    """``OMP_NUM_THREADS`` of this process, else 1: several engines share the host's cores, and
    oversubscribed thread pools make every engine slower than one thread each."""
    try:
        return max(1, int(os.environ.get("OMP_NUM_THREADS", "1")))
    except ValueError:
        return 1


class LocalProcessLauncher:
    """Engine processes on this host, at most ``max_engines`` alive at once. ``factory(model_dir,
    attempt=..., **engine_kwargs)`` builds one (default :class:`NativeEngineProcess`; SGLang servers:
    relax.services.launchers.sglang_process); it may raise :class:`CapacityError` (no free GPU)."""

    def __init__(self, model_dir: str | Path, max_engines: int, *, startup_timeout_s: float = 180.0,
                 factory: Callable[..., EngineProcess] = NativeEngineProcess, **engine_kwargs):
        if max_engines < 1:
            raise ValueError(f"max_engines must be >= 1, got {max_engines}")
        self.model_dir = str(model_dir)
        self.max_engines = max_engines
        self.startup_timeout_s = startup_timeout_s
        self.factory = factory
        self.engine_kwargs = engine_kwargs
        self._engines: list[EngineProcess] = []
        self._launches = 0  # launch() calls so far: the attempt of the engines the next one starts
        self._lock = threading.Lock()

    def running(self) -> list[EngineProcess]:
        with self._lock:
            self._engines = [e for e in self._engines if e.alive]
            return list(self._engines)

    def launch(self, n: int) -> list[EngineProcess]:
        """``n`` healthy engines, or none: one that cannot start stops the others and raises."""
        return self._launch(n, spare_killed=False)[0]

    def launch_surviving(self, n: int) -> tuple[list[EngineProcess], int]:
        """A pool's first ``n`` engines: those that came up, and how many were killed by a signal as
        they started (counted, for the pool's supervisor to replace like an engine that dies later).
        An engine that fails with an error of its own still fails the launch: a replacement would
        repeat it."""
        return self._launch(n, spare_killed=True)

    def _launch(self, n: int, spare_killed: bool) -> tuple[list[EngineProcess], int]:
        if n < 1:
            raise ValueError(f"launch needs n >= 1, got {n}")
        started: list[EngineProcess] = []
        killed: list[EngineProcess] = []
        try:
            with self._lock:  # reserve the slots before the slow start, so two launches cannot overshoot
                self._engines = [e for e in self._engines if e.alive]
                free = self.max_engines - len(self._engines)
                if n > free:
                    raise CapacityError(f"cannot launch {n} engine(s): {len(self._engines)} of max_engines="
                                        f"{self.max_engines} are running, so {free} more fit; ask for at most {free} "
                                        f"or scale in first")
                attempt = current_attempt() + self._launches
                self._launches += 1
                for _ in range(n):  # one that cannot start (no free GPU) takes the others down with it
                    started.append(self.factory(self.model_dir, attempt=attempt, **self.engine_kwargs))
                self._engines += started
            for e in started:
                try:
                    e.wait_healthy(self.startup_timeout_s)
                except EngineStartFailed as failed:
                    if not (spare_killed and failed.killed):
                        raise
                    killed.append(e)
        except BaseException:
            for e in started:
                e.stop()
            raise
        for e in killed:
            e.stop()  # forgets its reaper record; its slot frees as it is not alive
        return [e for e in started if e not in killed], len(killed)

    def stop_all(self) -> None:
        for e in self.running():
            e.stop()
