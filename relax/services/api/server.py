"""Serving the elastic rollout REST API from the rollout's own process (``rollout.api_port``).

The API must act on the very pool the rollout sends its requests through, so it runs beside
the rollout loop: uvicorn on a daemon thread of the rollout process, its scale operations on
worker threads, and the pool's own event loop doing the HTTP to engines. The rollout loop is
never blocked by it; a scale-out's new engine joins the next generation round it reaches.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

from relax.rollout.remote_engines import RemoteEngines
from relax.services.api.elastic import TOKEN_ENV, ElasticRollout, create_rollout_app
from relax.transfer.weights import WeightStore

log = logging.getLogger(__name__)


class APIStartError(RuntimeError):
    """The API could not start (no token, port taken); the message names the setting to change."""


def _check_port_free(host: str, port: int) -> None:
    # uvicorn reports a taken port by logging and exiting its thread; binding here first turns it
    # into an error that names the setting
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            why = "is in use" if e.errno == errno.EADDRINUSE else f"cannot be bound ({e.strerror})"
            raise APIStartError(f"rollout.api_port {port} on {host} {why}; choose another rollout.api_port "
                                f"(or rollout.api_port=0 to run without the REST API)") from None


def preflight(host: str, port: int, token: str | None = None, check_port: bool = True) -> str:
    """The token to serve with, or APIStartError naming what is missing; run before any engine
    starts. ``check_port=False`` when Ray Serve's proxy owns the port (async topology)."""
    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None:
        raise APIStartError(f"rollout.api_port={port} serves the elastic REST API, whose scale routes need a "
                            f"bearer token: set the {TOKEN_ENV} environment variable for the rollout process")
    if check_port:
        _check_port_free(host, port)
    return token


def lazy_rollout_app(get_elastic: Callable[[], ElasticRollout | None]) -> Callable:
    """An ASGI app for Ray Serve's ingress (async topology): 503 until the rollout role has its
    engine pool (``get_elastic()`` returns None meanwhile), then the API on that pool."""
    built: dict[str, Any] = {}

    async def app(scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "lifespan":  # nothing to set up or tear down
            while True:
                message = await receive()
                if message["type"] == "lifespan.startup":
                    await send({"type": "lifespan.startup.complete"})
                elif message["type"] == "lifespan.shutdown":
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        elastic = get_elastic()
        if elastic is None:
            from fastapi.responses import JSONResponse

            await JSONResponse({"detail": "the rollout is still starting its engines; retry in a few seconds"},
                               status_code=503)(scope, receive, send)
            return
        if "app" not in built:
            built["app"] = create_rollout_app(elastic)
        await built["app"](scope, receive, send)

    return app


class ServerThread:
    """uvicorn serving ``app`` on a daemon thread of this process: on ``host:port``, or on ``sockets`` the
    caller bound already (so a taken port is its own error, and port 0 has its number before serving)."""

    def __init__(self, app: Any, name: str, *, host: str | None = None, port: int | None = None,
                 sockets: list[socket.socket] | None = None):
        import uvicorn

        config = uvicorn.Config(app, host=host, port=port, log_level="warning") if sockets is None \
            else uvicorn.Config(app, log_level="warning")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": sockets} if sockets else {},
                                       name=name, daemon=True)

    def start(self, timeout_s: float) -> str | None:
        """Serve, and wait until uvicorn is up: None, or why it is not (a server that timed out is stopped)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive():
                return "exited while starting (see the log above)"
            if time.monotonic() > deadline:
                self.stop()
                return f"did not start within {timeout_s:.0f} s"
            time.sleep(0.02)
        return None

    def stop(self) -> None:
        self.server.should_exit = True
        if self.thread.is_alive():
            self.thread.join(timeout=10)


class RolloutAPIServer:
    """The API app on ``host:port`` in a daemon thread; :meth:`stop` shuts it down."""

    def __init__(self, pool: RemoteEngines, store: WeightStore, host: str, port: int, token: str | None = None,
                 drain_timeout_s: float = 300.0):
        token = preflight(host, port, token)
        # engines launched through the API are the same kind the pool owns (and replaces)
        self.elastic = ElasticRollout(pool, store, pool.launcher, drain_timeout_s=drain_timeout_s)
        app = create_rollout_app(self.elastic, token=token)
        self.url = f"http://{host}:{port}"
        self._serving = ServerThread(app, "relax-rollout-api", host=host, port=port)

    def start(self, timeout_s: float = 30.0) -> RolloutAPIServer:
        problem = self._serving.start(timeout_s)
        if problem:
            raise APIStartError(f"the rollout REST API on {self.url} {problem}")
        log.info("rollout REST API on %s (docs: %s/docs)", self.url, self.url)
        return self

    def stop(self) -> None:
        self._serving.stop()
