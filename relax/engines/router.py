"""Client-side router over several engines: least-outstanding balancing and failover.

Why in-process instead of sglang-router: the rollout side already knows every request it
sends, so counting outstanding requests per engine is exact and free, and elastic
add/remove (with draining) needs no extra process. A request whose engine dies
(connection refused/reset after the client's own retries) is re-sent to another engine;
the engine is marked unhealthy and skipped until :meth:`Router.check_health` sees it again.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from relax.engines.client import EngineClient, EngineUnavailable


class NoEngineAvailable(RuntimeError):
    """Every engine is removed, draining or unhealthy."""


class _Entry:
    def __init__(self, client: EngineClient):
        self.client = client
        self.healthy = True
        self.draining = False
        self.idle = asyncio.Event()
        self.idle.set()


class Router:
    """``await router.generate(input_ids=..., sampling_params=...)`` on the least-loaded engine.

    ``client_kwargs`` (timeout_s, retries, backoff_s) are passed to each new EngineClient;
    keep ``retries`` small so a dead engine is given up on quickly and the request moves on.
    """

    def __init__(self, urls: list[str] | None = None, **client_kwargs: Any):
        self.client_kwargs = {"retries": 1, "backoff_s": 0.2, **client_kwargs}
        self._entries: dict[str, _Entry] = {}
        self._rr = itertools.count()
        for url in urls or []:
            self._entries[url.rstrip("/")] = _Entry(EngineClient(url, **self.client_kwargs))

    async def add_engine(self, url: str) -> None:
        """Start routing to ``url`` once ``GET /health`` answers 200; raises if it does not."""
        url = url.rstrip("/")
        client = EngineClient(url, **self.client_kwargs)
        if not await client.health():
            await client.close()
            raise EngineUnavailable(f"engine {url} is not healthy (GET /health failed); not added")
        old = self._entries.pop(url, None)
        if old is not None:
            await old.client.close()
        self._entries[url] = _Entry(client)

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
        return [{"url": u, "outstanding": e.client.outstanding, "healthy": e.healthy, "draining": e.draining}
                for u, e in self._entries.items()]

    def _pick(self, exclude: set[str]) -> tuple[str, _Entry]:
        live = [(u, e) for u, e in self._entries.items() if e.healthy and not e.draining and u not in exclude]
        if not live:
            raise NoEngineAvailable(f"no engine to route to (engines: {self.engines()}, tried: {sorted(exclude)})")
        least = min(e.client.outstanding for _, e in live)
        ties = [x for x in live if x[1].client.outstanding == least]
        return ties[next(self._rr) % len(ties)]

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """Run ``EngineClient.<method>`` on the least-loaded engine, failing over on a dead engine."""
        tried: set[str] = set()
        while True:
            url, entry = self._pick(tried)
            entry.idle.clear()
            counted = method != "generate"  # EngineClient.generate counts itself
            if counted:
                entry.client.outstanding += 1
            try:
                return await getattr(entry.client, method)(*args, **kwargs)
            except EngineUnavailable:
                entry.healthy = False
                tried.add(url)
            finally:
                if counted:
                    entry.client.outstanding -= 1
                if entry.client.outstanding == 0:
                    entry.idle.set()

    async def generate(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call("generate", *args, **kwargs)

    async def chat(self, *args: Any, **kwargs: Any) -> Any:
        return await self.call("chat", *args, **kwargs)

    async def check_health(self) -> list[dict[str, Any]]:
        """Probe every engine's /health and update its ``healthy`` flag (a dead one can come back)."""
        entries = list(self._entries.values())
        oks = await asyncio.gather(*(e.client.health() for e in entries))
        for e, ok in zip(entries, oks, strict=True):
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
