"""Keeping a :class:`~relax.rollout.remote_engines.RemoteEngines` pool's engines serving.

Engines come in two kinds. *External* ones (plain URLs) are routed around when they fail and,
by :class:`EngineSupervisor`, routed to again once they answer ``/health`` with the current
weights; nothing here can restart them. *Owned* ones are processes the pool stops on close;
the supervisor replaces one whose process exited or that the router marked unhealthy with a
fresh one from the launcher, which loads the current weight version from the WeightStore
before it gets traffic.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Protocol

from relax.engines.router import Router
from relax.transfer.weights import WeightStore

log = logging.getLogger(__name__)


class LaunchedEngine(Protocol):
    """What the pool keeps of an engine it owns: where it serves, whether its process still
    runs (the supervisor replaces it once it does not), how to stop it."""

    @property
    def url(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class EngineLauncher(Protocol):
    """``launch(n)`` starts ``n`` healthy engines or raises (relax.services.launchers.process:
    LocalProcessLauncher, and its CapacityError when refused)."""

    def launch(self, n: int) -> list[LaunchedEngine]: ...


class SupervisedPool(Protocol):
    """What the supervisor uses of its pool (:class:`~relax.rollout.remote_engines.RemoteEngines`):
    the owned processes by URL, the router's table, the store and the version being loaded, a
    way onto the pool's event loop, and ``admit`` (load the current weights, then route)."""

    owned: dict[str, LaunchedEngine]
    router: Router
    store: WeightStore | None
    target_version: int

    def run(self, coro: Any, timeout: float | None = None) -> Any: ...

    async def admit(self, url: str, store: WeightStore | None) -> None: ...

    def weights_at(self, store: WeightStore, version: int) -> str: ...


class EngineSupervisor:
    """Supervision passes over ``pool``: retire owned engines that died or turned unhealthy,
    launch their replacements (a failed launch is retried on the next pass), re-admit external
    engines that answer again. The pool owns its supervisor (``pool.supervisor``); with
    ``interval_s > 0`` a background thread runs :meth:`supervise` that often."""

    def __init__(self, pool: SupervisedPool, launcher: EngineLauncher | None = None, interval_s: float = 0.0):
        self.pool = pool
        self.launcher = launcher
        self.replaced = 0  # owned engines replaced
        self.vacancies = 0  # owned engines retired and not replaced yet
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._thread = threading.Thread(target=self._supervise_forever, args=(interval_s,),
                                            name="relax-engine-supervisor", daemon=True)
            self._thread.start()

    def supervise(self) -> dict[str, list[str]]:
        """One pass: replace owned engines that died or turned unhealthy, bring back external ones
        that answer again. Returns ``{"retired": [...], "added": [...], "revived": [...]}``."""
        with self._lock:
            return self.pool.run(self._supervise())

    def _supervise_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.supervise()
            except Exception:  # the next pass retries; a supervisor that dies would leave dead engines
                log.exception("engine supervision pass failed; retrying in %.1f s", interval_s)

    async def _supervise(self) -> dict[str, list[str]]:
        pool = self.pool
        out: dict[str, list[str]] = {"retired": [], "added": [], "revived": []}
        table = {e["url"]: e for e in pool.router.engines()}
        for url, process in list(pool.owned.items()):
            e = table.get(url)
            if e is None or e["draining"]:
                continue  # being removed by its owner (a scale-in), not ours to replace
            if not process.alive:
                why = "its process exited"
            elif not e["healthy"]:
                why = f"it is unhealthy ({e['failures']} failures; last: {e['last_error'] or 'no answer'})"
            else:
                continue
            await self.retire(url, why)
            out["retired"].append(url)
        out["added"] = await self._fill_vacancies()
        for e in pool.router.engines():  # read again: the retired engines are gone from it
            url = e["url"]
            if url not in pool.owned and not e["healthy"] and not e["draining"] and await self._revive(url):
                out["revived"].append(url)
        return out

    async def retire(self, url: str, why: str) -> None:
        """Take an owned engine out of rotation and stop it; a replacement is owed (a vacancy)."""
        process = self.pool.owned.pop(url, None)
        if process is None:
            return  # retired already (a failed weight load and a supervision pass can both find it)
        if self.launcher is None:
            log.warning("owned engine %s is out of rotation: %s; no launcher to replace it", url, why)
        else:
            log.warning("replacing owned engine %s: %s", url, why)
        remover = asyncio.ensure_future(self.pool.router.remove_engine(url, drain=True, timeout_s=60))
        await asyncio.sleep(0)  # the removal marks it draining first: no new requests go to it
        await asyncio.to_thread(process.stop)  # requests still on it fail and move to other engines
        try:
            await remover
        except KeyError:
            pass  # already removed
        except asyncio.TimeoutError:
            await self.pool.router.remove_engine(url, drain=False)
        self.vacancies += 1

    async def _fill_vacancies(self) -> list[str]:
        added: list[str] = []
        while self.vacancies and self.launcher is not None and not self._stop.is_set():
            try:
                [process] = await asyncio.to_thread(self.launcher.launch, 1)
            except Exception as e:
                log.warning("could not start a replacement engine (%s: %s); the next pass retries", type(e).__name__, e)
                break
            url = process.url.rstrip("/")
            try:
                await self.pool.admit(url, self.pool.store)  # the current weights first, then traffic
            except Exception as e:
                await asyncio.to_thread(process.stop)
                log.warning("replacement engine %s did not come up (%s); the next pass retries", url, e)
                break
            self.pool.owned[url] = process
            self.vacancies -= 1
            self.replaced += 1
            added.append(url)
        return added

    async def _revive(self, url: str) -> bool:
        """Route to an external engine again once it answers /health and serves (or loads) the
        current weights: an engine that restarted holds its initial ones."""
        pool = self.pool
        try:
            client = pool.router.client(url)
        except KeyError:
            return False  # removed meanwhile (a scale-in)
        if not await client.health():
            return False
        version = pool.target_version
        if version >= 0:
            try:
                info = await client.model_info()
                if str(info.get("weight_version")) != str(version):
                    if pool.store is None:
                        return False
                    r = await client.update_weights_from_disk(pool.weights_at(pool.store, version), str(version))
                    if not r.get("success"):
                        return False
            except Exception as e:  # still broken: stays out of rotation, the next pass retries
                log.info("engine %s answers /health but not its weight check (%s)", url, e)
                return False
        if pool.target_version != version:
            return False  # the pool moved on while it loaded; the next pass checks again
        pool.router.mark_healthy(url)
        log.warning("engine %s is healthy again with weight version %s; routing to it", url, version)
        return True

    def stop(self) -> None:
        """No more passes or replacements; replacement engines being started are stopped too."""
        self._stop.set()
        stop_all = getattr(self.launcher, "stop_all", None)
        if stop_all is not None:
            stop_all()

    def join(self, timeout: float | None = None) -> None:
        """Wait for the background thread (if any) to finish its pass, after :meth:`stop`."""
        if self._thread is not None:
            self._thread.join(timeout=timeout)
