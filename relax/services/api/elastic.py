"""The elastic rollout REST API: add and remove inference engines while a run trains.

:class:`ElasticRollout` owns the scale operations on a :class:`~relax.rollout.remote_engines.RemoteEngines`
pool; :func:`create_rollout_app` puts them behind FastAPI (OpenAPI at ``/openapi.json``).

Rules the API keeps (see docs/rest_api.md):

* A new engine loads the pool's current weight version before it is routed to, so it never
  serves stale weights.
* A scale-in drains: the engine stops getting new requests, its outstanding ones finish, then
  it is removed (and stopped, if this API launched it).
* Engines this API launches are handed to the pool, which owns them from then on: its
  supervisor (``RemoteEngines.supervise``) replaces one that dies, through the same launcher.
* One scale operation at a time; a second one gets HTTP 409 naming the running one.
* A scale-out is all or nothing: if any engine fails to come up, the ones it already added are
  removed again and launched processes stopped.
* Operations run to completion inside the request (in a worker thread), so a POST answers 200
  with the final state; an ``operation_id`` makes a retried POST return the recorded result
  instead of scaling twice.
* Every POST needs ``Authorization: Bearer <token>``; GETs are read-only and open.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import threading
import time
import uuid
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field, model_validator

from relax.config.preflight import API_TOKEN_ENV as TOKEN_ENV
from relax.rollout.engine_supervisor import EngineLauncher, LaunchedEngine
from relax.rollout.remote_engines import RemoteEngines
from relax.services.launchers.process import CapacityError
from relax.transfer.weights import WeightStore


class OperationBusy(RuntimeError):
    """Another scale operation is running."""

    def __init__(self, running: Operation):
        super().__init__(f"scale operation {running.operation_id} ({running.kind}) is running; wait until "
                         f"GET /rollout/operations/{running.operation_id} reports it finished, then retry")
        self.running = running


class OperationConflict(RuntimeError):
    """An operation_id was reused for a different request."""


class BadScaleRequest(ValueError):
    """The request cannot be carried out as asked (unknown engine, no launcher, too many to remove...)."""


@dataclass
class Operation:
    operation_id: str
    kind: str  # scale_out | scale_in
    request: dict[str, Any]
    status: str = "pending"  # pending | running | succeeded | failed
    error: str | None = None
    engines_added: list[str] = field(default_factory=list)
    engines_removed: list[str] = field(default_factory=list)
    engines_skipped: list[str] = field(default_factory=list)  # asked to add, already in the pool
    created_at: float = field(default_factory=time.time)
    finished_at: float | None = None
    http_status: int = 200  # what a POST for this operation answers, repeated verbatim on a retry

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.pop("http_status")
        return out


class ElasticRollout:
    """Scale operations over ``pool``; ``store`` supplies weights to new engines, ``launcher`` starts them
    (and becomes the pool's launcher for replacements, unless the pool has one)."""

    def __init__(self, pool: RemoteEngines, store: WeightStore | None = None, launcher: EngineLauncher | None = None,
                 *, drain_timeout_s: float = 300.0, keep_operations: int = 256):
        self.pool = pool
        self.store = store
        self.launcher = launcher
        self.drain_timeout_s = drain_timeout_s
        self.keep_operations = keep_operations
        self._lock = threading.Lock()
        self._ops: OrderedDict[str, Operation] = OrderedDict()
        self._current: Operation | None = None
        # launched engines are owned by the pool (pool.owned), so a replacement stays owned too
        if launcher is not None and pool.launcher is None:
            pool.launcher = launcher
        if store is not None and pool.store is None:
            pool.store = store

    # -- bookkeeping -----------------------------------------------------------------------------
    def begin(self, kind: str, request: dict[str, Any], operation_id: str | None = None) -> tuple[Operation, bool]:
        """``(operation, is_new)``; a known ``operation_id`` returns its operation instead of a new one."""
        with self._lock:
            if operation_id is not None and operation_id in self._ops:
                op = self._ops[operation_id]
                if op.kind != kind or op.request != request:
                    raise OperationConflict(f"operation_id {operation_id!r} was already used for {op.kind} "
                                            f"{op.request}; use a new operation_id for a different request")
                return op, False
            if self._current is not None:
                raise OperationBusy(self._current)
            op = Operation(operation_id or uuid.uuid4().hex, kind, request)
            self._ops[op.operation_id] = op
            while len(self._ops) > self.keep_operations:
                self._ops.popitem(last=False)
            self._current = op
            return op, True

    def operation(self, operation_id: str) -> Operation | None:
        with self._lock:
            return self._ops.get(operation_id)

    def execute(self, op: Operation) -> Operation:
        """Carry out a begun operation (blocking); its outcome is recorded on ``op``, never raised."""
        op.status = "running"
        try:
            if op.kind == "scale_out":
                self._scale_out(op)
            else:
                self._scale_in(op)
            op.status = "succeeded"
        except (CapacityError, BadScaleRequest) as e:
            op.status, op.error, op.http_status = "failed", str(e), 400
        except Exception as e:
            op.status, op.error, op.http_status = "failed", f"{type(e).__name__}: {e}", 502
        finally:
            op.finished_at = time.time()
            with self._lock:
                self._current = None
        return op

    def engines(self) -> list[dict[str, Any]]:
        version = self.pool.weight_version
        owned = set(self.pool.owned)
        return [{**e, "weight_version": version, "launched": e["url"] in owned} for e in self.pool.engines()]

    def close(self) -> None:
        """Stop the engine processes the pool owns: those this API launched and their replacements
        (the pool itself belongs to the caller)."""
        self.pool.stop_owned()

    # -- the operations ----------------------------------------------------------------------------
    def _scale_out(self, op: Operation) -> None:
        if self.store is None and self.pool.weight_version >= 0:
            raise BadScaleRequest(f"the pool serves weight version {self.pool.weight_version} but this API has "
                                  "no WeightStore to load it into new engines; give ElasticRollout the run's store")
        launched: list[LaunchedEngine] = []
        processes: dict[str, LaunchedEngine] = {}
        try:
            if op.request.get("num_replicas"):
                if self.launcher is None:
                    raise BadScaleRequest("this API has no engine launcher, so it cannot start replicas; start "
                                          "the engines yourself and pass their URLs as engine_urls")
                launched = list(self.launcher.launch(int(op.request["num_replicas"])))
                processes = {e.url.rstrip("/"): e for e in launched}
                urls = list(processes)
            else:
                urls = list(dict.fromkeys(u.rstrip("/") for u in op.request["engine_urls"]))
            present = {e["url"] for e in self.engines()}
            for url in urls:
                if url in present:
                    op.engines_skipped.append(url)
                    continue
                # loads the current version (and a newer one if the pool moves); launched ones become owned
                self.pool.add_engine(url, self.store, process=processes.get(url))
                op.engines_added.append(url)
        except BaseException:
            self._undo_scale_out(op, launched)
            raise

    def _undo_scale_out(self, op: Operation, launched: list[LaunchedEngine]) -> None:
        for url in op.engines_added:
            try:  # stops it too if it was launched (the pool owns it by now)
                self.pool.remove_engine(url, drain=True, timeout_s=self.drain_timeout_s)
            except Exception:  # the engine is gone already; nothing left to undo
                pass
        op.engines_removed, op.engines_added = list(op.engines_added), []
        for e in launched:
            e.stop()  # a no-op for one already stopped

    def _scale_in(self, op: Operation) -> None:
        current = [e["url"] for e in self.engines()]
        if op.request.get("engine_urls"):
            urls = list(dict.fromkeys(u.rstrip("/") for u in op.request["engine_urls"]))
            unknown = [u for u in urls if u not in current]
            if unknown:
                raise BadScaleRequest(f"not in the pool: {unknown}; GET /rollout/engines lists the engines {current}")
        else:
            n = int(op.request["num_replicas"])
            # Launched (owned) engines go first: they are the ones this API can give back to the host.
            owned = set(self.pool.owned)
            order = [u for u in reversed(current) if u in owned] + [u for u in reversed(current) if u not in owned]
            urls = order[:n]
        if len(urls) >= len(current):
            raise BadScaleRequest(f"removing {len(urls)} of the {len(current)} engines would leave the rollout "
                                  f"with none; scale out first or remove fewer")
        timeout = op.request.get("drain_timeout_s") or self.drain_timeout_s

        failed = {}
        for url, r in self.pool.remove_engines(urls, drain=True, timeout_s=timeout).items():
            if isinstance(r, BaseException):
                failed[url] = f"did not drain within {timeout} s" if isinstance(r, asyncio.TimeoutError) else repr(r)
                continue
            op.engines_removed.append(url)  # the pool stopped it if it owned it
        if failed:
            raise RuntimeError(f"engines not removed: {failed}; they stay in the pool marked draining (no new "
                               f"requests): retry scale_in, with a larger drain_timeout_s if they are busy")


# -- HTTP ----------------------------------------------------------------------------------------
class ScaleOutRequest(BaseModel):
    """Exactly one of ``num_replicas`` (engines the API launches) and ``engine_urls`` (running engines)."""

    num_replicas: int | None = Field(None, gt=0, description="native engines to launch on this host")
    engine_urls: list[str] | None = Field(None, min_length=1, description="URLs of running engines to add")
    operation_id: str | None = Field(None, min_length=1, max_length=200,
                                     description="idempotency key: a retry with the same id returns the same operation")

    @model_validator(mode="after")
    def _one_of(self) -> ScaleOutRequest:
        if (self.num_replicas is None) == (self.engine_urls is None):
            raise ValueError("give exactly one of num_replicas and engine_urls")
        return self


class ScaleInRequest(BaseModel):
    """Exactly one of ``num_replicas`` (launched engines go first) and ``engine_urls``."""

    num_replicas: int | None = Field(None, gt=0, description="how many engines to remove")
    engine_urls: list[str] | None = Field(None, min_length=1, description="URLs of the engines to remove")
    operation_id: str | None = Field(None, min_length=1, max_length=200,
                                     description="idempotency key: a retry with the same id returns the same operation")
    drain_timeout_s: float | None = Field(None, gt=0, description="how long outstanding requests may take")

    @model_validator(mode="after")
    def _one_of(self) -> ScaleInRequest:
        if (self.num_replicas is None) == (self.engine_urls is None):
            raise ValueError("give exactly one of num_replicas and engine_urls")
        return self


def create_rollout_app(elastic: ElasticRollout, token: str | None = None) -> FastAPI:
    """The FastAPI app; ``token`` (else env ``RELAX_API_TOKEN``) guards every POST and is required."""
    token = token or os.environ.get(TOKEN_ENV) or None
    if token is None:
        raise ValueError(f"the rollout REST API needs a bearer token for its mutating routes: pass token=... or "
                         f"set {TOKEN_ENV}; it never runs scale operations unauthenticated")
    app = FastAPI(title="Relax elastic rollout", description="Add and remove inference engines of a running rollout.")
    app.state.elastic = elastic
    bearer = HTTPBearer(auto_error=False)

    def authorized(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or creds.scheme.lower() != "bearer" or \
                not hmac.compare_digest(creds.credentials.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token: send 'Authorization: Bearer <token>' with "
                                     f"the API's token ({TOKEN_ENV})", headers={"WWW-Authenticate": "Bearer"})

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, e: RequestValidationError) -> JSONResponse:
        reasons = "; ".join(f"{'.'.join(str(p) for p in err['loc'][1:]) or 'body'}: {err['msg']}"
                            for err in e.errors())
        return JSONResponse({"detail": f"invalid request: {reasons}"}, status_code=400)

    async def run(kind: str, body: ScaleOutRequest | ScaleInRequest) -> JSONResponse:
        request = body.model_dump(exclude_none=True, exclude={"operation_id"})
        try:
            op, new = elastic.begin(kind, request, body.operation_id)
        except (OperationBusy, OperationConflict) as e:
            raise HTTPException(409, str(e)) from None
        if new:
            await asyncio.to_thread(elastic.execute, op)
        if op.status in ("pending", "running"):  # a retry of an operation still in progress
            return JSONResponse(op.to_dict(), status_code=202)
        if op.status == "failed":
            return JSONResponse({"detail": op.error, **op.to_dict()}, status_code=op.http_status)
        return JSONResponse(op.to_dict())

    @app.post("/rollout/scale_out", summary="Add engines (launch replicas or add running engines by URL)",
              dependencies=[Depends(authorized)])
    async def scale_out(body: ScaleOutRequest) -> JSONResponse:
        return await run("scale_out", body)

    @app.post("/rollout/scale_in", summary="Drain and remove engines", dependencies=[Depends(authorized)])
    async def scale_in(body: ScaleInRequest) -> JSONResponse:
        return await run("scale_in", body)

    @app.get("/rollout/engines", summary="The engines of the pool")
    def engines() -> dict[str, Any]:
        return {"weight_version": elastic.pool.weight_version, "engines": elastic.engines()}

    @app.get("/rollout/operations/{operation_id}", summary="State of a scale operation")
    @app.get("/rollout/scale_out/{operation_id}", summary="State of a scale operation (alias)")
    def operation(operation_id: str) -> dict[str, Any]:
        op = elastic.operation(operation_id)
        if op is None:
            raise HTTPException(404, f"no operation {operation_id!r} (the API keeps the last "
                                     f"{elastic.keep_operations})")
        return op.to_dict()

    @app.get("/health", summary="The API answers")
    def health() -> dict[str, Any]:
        return {}

    return app
