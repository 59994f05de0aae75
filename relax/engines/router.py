"""Client-side router over several engines: least-outstanding balancing and failover.

Why in-process instead of sglang-router: the rollout side already knows every request it
sends, so counting outstanding requests per engine is exact and free, and elastic
add/remove (with draining) needs no extra process.

Faults, and what each does to the engine that caused it:

* unreachable (connection refused/reset after the client's own retries): the engine is
  marked unhealthy at once, since it is down;
* a malformed answer (:class:`~relax.engines.client.EngineBadResponse`), a request past the
  timeout (:class:`~relax.engines.client.EngineTimeout`) or a 5xx after the client's retries:
  the engine's consecutive-failure count grows, and at ``max_failures`` it is marked
  unhealthy; any success resets the count.

Either way the request is re-sent to another engine (one it has not tried yet). An unhealthy
engine gets no traffic until :meth:`Router.check_health` (or :meth:`Router.mark_healthy`)
brings it back; replacing engines is the owner's job (``RemoteEngines.supervise``).
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from relax.engines.client import (
    EngineBadResponse,
    EngineClient,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
)


class NoEngineAvailable(RuntimeError):
    """Every engine is removed, draining or unhealthy."""


class _Entry:
    def __init__(self, client: EngineClient):
        self.client = client
        self.healthy = True
        self.draining = False
        self.ready = True  # False while its owner loads weights: in broadcasts, not routed to
        self.idle = asyncio.Event()
        self.idle.set()
        self.consecutive_failures = 0
        self.failures = 0  # all failures since the engine was added
        self.last_error = ""


def _is_fault(e: BaseException) -> bool:
    """A failure that says the engine, not the request, is broken (a 4xx is the caller's)."""
    return isinstance(e, (EngineBadResponse, EngineTimeout)) or (isinstance(e, EngineHTTPError) and e.status >= 500)


class Router:
    """``await router.generate(input_ids=..., sampling_params=...)`` on the least-loaded engine.

    ``client_kwargs`` (timeout_s, retries, backoff_s, vocab_size) are passed to each new
    EngineClient; keep ``retries`` small so a dead engine is given up on quickly and the request
    moves on. ``max_failures`` consecutive faulty answers mark an engine unhealthy;
    ``max_tries`` bounds how many engines one request is sent to after faulty answers (dead
    engines do not count: they are out of rotation after one try).
    """

    def __init__(self, urls: list[str] | None = None, *, max_failures: int = 3, max_tries: int = 3,
                 **client_kwargs: Any):
        if max_failures < 1 or max_tries < 1:
            raise ValueError(f"max_failures and max_tries must be >= 1, got {max_failures} and {max_tries}")
        self.client_kwargs = {"retries": 1, "backoff_s": 0.2, **client_kwargs}
        self.max_failures = max_failures
        self.max_tries = max_tries
        self.retries = 0  # requests re-sent to another engine after a failure
        self.unhealthy_marks = 0  # times an engine was taken out of rotation for failing
        self._entries: dict[str, _Entry] = {}
        self._rr = itertools.count()
        for url in urls or []:
            self._entries[url.rstrip("/")] = _Entry(EngineClient(url, **self.client_kwargs))

    async def add_engine(self, url: str, ready: bool = True) -> None:
        """Start routing to ``url`` once ``GET /health`` answers 200; raises if it does not.

        ``ready=False`` adds it to the table (broadcasts reach it) without routing requests to it
        until :meth:`mark_ready`, so its owner can bring it to the current weights first."""
        url = url.rstrip("/")
        client = EngineClient(url, **self.client_kwargs)
        if not await client.health():
            await client.close()
            raise EngineUnavailable(f"engine {url} is not healthy (GET /health failed); not added")
        old = self._entries.pop(url, None)
        if old is not None:
            await old.client.close()
        entry = _Entry(client)
        entry.ready = ready
        self._entries[url] = entry

    def mark_ready(self, url: str) -> None:
        self._entries[url.rstrip("/")].ready = True

    async def remove_engine(self, url: str, drain: bool = True, timeout_s: float | None = None) -> None:
        """Stop routing to ``url``; with ``drain`` wait until its outstanding requests finish."""
        entry = self._entries.get(url.rstrip("/"))
        if entry is None:
            raise KeyError(f"no engine {url}; have {list(self._entries)}")
        entry.draining = True
        if drain:
            await asyncio.wait_for(entry.idle.wait(), timeout_s)
        self._entries.pop(url.rstrip("/"), None)
        await entry.client.close()

    def engines(self) -> list[dict[str, Any]]:
        return [
            {
                "url": u,
                "outstanding": e.client.outstanding,
                "healthy": e.healthy,
                "draining": e.draining,
                "ready": e.ready,
                "consecutive_failures": e.consecutive_failures,
                "failures": e.failures,
                "last_error": e.last_error,
            }
            for u, e in self._entries.items()
        ]

    def client(self, url: str) -> EngineClient:
        """The client of engine ``url`` (for probes by its owner); KeyError if it is not routed to."""
        return self._entries[url.rstrip("/")].client

    def _pick(self, exclude: set[str]) -> tuple[str, _Entry]:
        live = [(u, e) for u, e in self._entries.items()
                if e.healthy and e.ready and not e.draining and u not in exclude]
        if not live:
            raise NoEngineAvailable(f"no engine to route to (engines: {self.engines()}, tried: {sorted(exclude)})")
        least = min(e.client.outstanding for _, e in live)
        ties = [x for x in live if x[1].client.outstanding == least]
        return ties[next(self._rr) % len(ties)]

    def _failed(self, entry: _Entry, error: BaseException, down: bool) -> None:
        entry.consecutive_failures += 1
        entry.failures += 1
        entry.last_error = str(error)[:500]
        if entry.healthy and (down or entry.consecutive_failures >= self.max_failures):
            entry.healthy = False
            self.unhealthy_marks += 1

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``EngineClient.<method>`` on the least-loaded engine, failing over on a dead or faulty one."""
        tried: set[str] = set()
        faults = 0
        last: BaseException | None = None
        while True:
            try:
                url, entry = self._pick(tried)
            except NoEngineAvailable as e:
                if last is None:
                    raise
                raise NoEngineAvailable(f"{e}; the last engine error was: {last}") from last
            if tried:
                self.retries += 1
            entry.idle.clear()
            counted = method != "generate"  # EngineClient.generate counts itself
            if counted:
                entry.client.outstanding += 1
            try:
                result = await getattr(entry.client, method)(*args, **kwargs)
                entry.consecutive_failures = 0
                return result
            except EngineUnavailable as e:
                self._failed(entry, e, down=True)
                tried.add(url)
                last = e
            except (EngineBadResponse, EngineTimeout, EngineHTTPError) as e:
                if not _is_fault(e):
                    raise  # the request's own fault (4xx): every engine would refuse it
                self._failed(entry, e, down=False)
                tried.add(url)
                last = e
                faults += 1
                if faults >= self.max_tries:
                    raise
            finally:
                if counted:
                    entry.client.outstanding -= 1
                if entry.client.outstanding == 0:
                    entry.idle.set()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call("generate", *args, **kwargs)

    async def chat(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call("chat", *args, **kwargs)

    def mark_healthy(self, url: str) -> None:
        """Route to ``url`` again with a clean failure count (its owner checked it)."""
        entry = self._entries[url.rstrip("/")]
        entry.healthy, entry.consecutive_failures = True, 0

    async def check_health(self) -> list[dict[str, Any]]:
        """Probe every engine's /health and update its ``healthy`` flag: one that answers is back
        in rotation with a clean consecutive-failure count, one that does not is taken out."""
        entries = list(self._entries.values())
        oks = await asyncio.gather(*(e.client.health() for e in entries))
        for e, ok in zip(entries, oks, strict=True):
            if ok and not e.healthy:
                e.consecutive_failures = 0
            e.healthy = ok
        return self.engines()

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Run a control call (update_weights_from_disk, flush_cache, abort...) on every engine."""
        urls = list(self._entries)
        results = await asyncio.gather(*(getattr(self._entries[u].client, method)(*args, **kwargs) for u in urls),
                                       return_exceptions=True)
        return dict(zip(urls, results, strict=True))

    async def close(self) -> None:
        for e in self._entries.values():
            await e.client.close()
