"""The rollout's pool of engines over HTTP: :class:`RemoteEngines`.

Any number of SGLang-compatible URLs (native servers, real SGLang) behind
:class:`relax.engines.router.Router`: least-loaded routing, fail-over when an engine dies or
answers garbage, weight versions loaded into every engine, engines added and removed at
runtime by the elastic REST API. Engine processes it owns are replaced when they die by its
:class:`~relax.rollout.engine_supervisor.EngineSupervisor`, and while none serves, the pool
waits for a replacement instead of failing.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from relax import liveness, objstore
from relax.engines.client import EngineClient
from relax.engines.guards import MAX_BODY_BYTES
from relax.engines.router import NoEngineAvailable, Router
from relax.engines.types import Completion, SamplingParams, routes_from_wire
from relax.rollout.engine_supervisor import EngineLauncher, EngineSupervisor, LaunchedEngine
from relax.rollout.prompts import EncodedPrompt
from relax.rollout.weight_sync import WEIGHT_SYNCS, BroadcastSync
from relax.transfer.weights import WeightStore

log = logging.getLogger(__name__)

# under an engine server's default body limit, with room for the JSON around the prompts
MAX_REQUEST_BYTES = MAX_BODY_BYTES * 3 // 4


class RemoteEngines:
    """SGLang-compatible engines by URL; a private event loop thread runs the async router.

    The pool routes (least-loaded, fail-over and failure counting in its router), loads weight
    versions into its engines, and adds and removes engines. *External* engines (plain URLs)
    are routed around when they fail; *owned* ones (``owned``, or ``add_engine(...,
    process=...)``) are processes this pool stops on removal or close. Keeping them serving is
    its :class:`~relax.rollout.engine_supervisor.EngineSupervisor` (``self.supervisor``,
    given ``launcher``): :meth:`supervise` runs one pass, and with ``supervise_interval_s > 0``
    a background thread runs one that often. :meth:`generate` sends one batched request per
    engine (split in turns of at most ``max_request_bytes``), so that runs repeat.

    ``timeout_s`` bounds each request to an engine and, in a pool with a launcher, the waits
    through an outage: when no engine is routable (its only engine died, or every engine failed
    to load a weight version), :meth:`generate` and :meth:`load_weights` run supervision passes
    until a replacement serves, for up to ``outage_timeout_s`` per call (checked between
    passes), then carry on (``engine_outages`` in :meth:`fault_counts`). A pool without a
    launcher cannot get a replacement and fails at once.
    """

    def __init__(self, urls: list[str], timeout_s: float = 120.0, *, owned: list[LaunchedEngine] | None = None,
                 launcher: EngineLauncher | None = None, store: WeightStore | None = None, max_failures: int = 3,
                 vocab_size: int | None = None, supervise_interval_s: float = 0.0,
                 max_request_bytes: int = MAX_REQUEST_BYTES, local_weights: bool = False,
                 weight_sync: str = "disk", routed_experts: bool = False):
        self.max_request_bytes = max_request_bytes
        self.routed_experts = routed_experts  # algorithm.routing_replay: ask each request for its experts
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relax-rollout-http", daemon=True)
        self._thread.start()
        self.owned: dict[str, LaunchedEngine] = {e.url.rstrip("/"): e for e in owned or []}
        urls = list(dict.fromkeys([*(u.rstrip("/") for u in urls), *self.owned]))
        self.router: Router = self.run(self._make_router(urls, timeout_s=timeout_s, max_failures=max_failures,
                                                         vocab_size=vocab_size))
        self.outage_timeout_s = timeout_s
        self.local_weights = local_weights  # SGLang reads a folder: weight versions go as local paths
        self.outages = 0  # times no engine was routable and the pool waited for a replacement
        self.store = store
        self.weight_version = -1
        self.target_version = -1  # the version being loaded: engines added meanwhile load it too
        self.removed: list[str] = []  # external engines dropped after refusing new weights
        self.supervisor = EngineSupervisor(self, launcher, supervise_interval_s)
        if weight_sync not in WEIGHT_SYNCS:
            raise ValueError(f"weight_sync={weight_sync!r}; choose one of {WEIGHT_SYNCS}")
        # rollout.weight_sync=broadcast: versions go over one process group (relax.rollout.weight_sync)
        self.sync = BroadcastSync(timeout_s=timeout_s) if weight_sync == "broadcast" else None

    @property
    def launcher(self) -> EngineLauncher | None:
        """Where the supervisor gets replacement engines (the elastic API may set it later)."""
        return self.supervisor.launcher

    @launcher.setter
    def launcher(self, launcher: EngineLauncher | None) -> None:
        self.supervisor.launcher = launcher

    @property
    def replaced(self) -> int:
        """Owned engines the supervisor replaced."""
        return self.supervisor.replaced

    @staticmethod
    async def _make_router(urls: list[str], **kwargs: Any) -> Router:
        return Router(urls, **kwargs)  # built on the loop that will use its clients

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the pool's loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """Completions per prompt. The prompts go as one batched ``/generate`` per routable engine,
        in contiguous shares of the list (the router places each share and fails it over whole):
        an engine admits a share together, as the in-process engine admits a step's requests, so
        which requests share a batch (and with it the padded shapes, and the last bits of every
        logprob) follows from the call, not from when each request happened to arrive. Sent one
        by one, that timing made runs with engine processes differ from each other.

        With no engine routable, a pool with a launcher waits for a replacement (see the class)
        and sends the whole call again with the same rids: the engine seeds each request from its
        rid, so the retry samples what the lost call would have."""
        if len(prompts) != len(params) or len(prompts) != len(rids):
            raise ValueError(f"{len(prompts)} prompts, {len(params)} sampling params and {len(rids)} rids; "
                             f"pass one of each per prompt")

        async def all_of() -> list[list[Completion]]:
            shares = _shares(len(prompts), max(1, _routable(self.router.engines())))
            # every share finishes before an error is raised: a retry must not meet this call's
            # requests still running under the same rids
            out = await asyncio.gather(*(self._share(prompts[a:b], params[a:b], rids[a:b]) for a, b in shares),
                                       return_exceptions=True)
            for share in out:
                if isinstance(share, BaseException):
                    raise share
            return [per_prompt for share in out for per_prompt in share]

        # one budget for the whole call, so an engine that dies on every request ends it
        deadline = None
        while True:
            try:
                return self.run(all_of())
            except NoEngineAvailable as e:
                if self.launcher is None:
                    raise
                deadline = deadline or time.monotonic() + self.outage_timeout_s
                # waited here, off the pool's loop: supervision passes run on that loop
                self._await_engine(deadline, "requests", {"generate": e})

    async def _share(self, prompts: list[EncodedPrompt], params: list[SamplingParams],
                     rids: list[str]) -> list[list[Completion]]:
        """One share: batches of at most ``max_request_bytes`` (an engine refuses larger bodies,
        and media prompts are large), each sent once the one before it is answered, so each is
        still admitted whole."""
        out: list[list[Completion]] = []
        for a, b in _by_size([_request_bytes(p) for p in prompts], self.max_request_bytes):
            out += await self._batch(prompts[a:b], params[a:b], rids[a:b])
        return out

    async def _batch(self, prompts: list[EncodedPrompt], params: list[SamplingParams],
                     rids: list[str]) -> list[list[Completion]]:
        """One batched ``/generate`` (a plain one for a single prompt) -> completions per prompt."""
        sps = [dataclasses.asdict(sp) for sp in params]  # the same names as SGLang's sampling_params
        # media goes as bytes beside the already expanded ids (docs/engines.md, "Media"): the
        # engine rebuilds the same tensors, and the tokens trained on are the ones it saw
        images = [[_data_uri(b, "image/png") for b in p.images] or None for p in prompts]
        audios = [[_data_uri(b, "audio/wav") for b in p.audios] or None for p in prompts]
        one = len(prompts) == 1
        out = await self.router.generate(
            input_ids=prompts[0].input_ids if one else [p.input_ids for p in prompts],
            sampling_params=sps[0] if one else sps, rid=rids[0] if one else rids, return_logprob=True,
            image_data=(images[0] if one else images) if any(images) else None,
            audio_data=(audios[0] if one else audios) if any(audios) else None,
            **({"return_routed_experts": True} if self.routed_experts else {}),
            **({"top_logprobs_num": top} if (top := max(sp.top_logprobs_num for sp in params)) else {}))  # SGLang's
        items = out if isinstance(out, list) else [out]
        result, at = [], 0
        for p, sp, rid in zip(prompts, params, rids, strict=True):
            result.append([_completion(rid, i, item, len(p.input_ids)) for i, item in enumerate(items[at:at + sp.n])])
            at += sp.n
        return result

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, store: WeightStore, version: int) -> None:
        """Load ``version`` into every engine; one that cannot is taken out of rotation (an owned
        one is replaced). If none could and the launcher owes replacements, wait for one to serve
        it (see the class); else raise."""
        self.store = store
        failed = self.run(self._load_all(store, version))
        if failed is not None:
            # a replacement loads the target version as it is admitted: the version is retried there
            self._await_engine(time.monotonic() + self.outage_timeout_s, f"weight version {version}", failed)
        self.weight_version = version

    async def _load_all(self, store: WeightStore, version: int) -> dict[str, Any] | None:
        """The broadcast; returns the errors when no engine loaded ``version`` but replacements are
        owed (the caller waits for them, off this loop), else None."""
        self.target_version = version  # set before the broadcast snapshots the engines (see admit)
        if self.sync is not None:  # rollout.weight_sync=broadcast; the disk way below when it fails
            urls = [e["url"] for e in self.router.engines() if e["ready"] and not e["draining"]]
            if await self.sync.push(urls, store, version):
                return None
        results = await self.router.broadcast("update_weights_from_disk", self.weights_at(store, version), str(version))
        failed = {u: r for u, r in results.items() if isinstance(r, Exception) or not r.get("success")}
        none_loaded = len(failed) == len(results)
        owed = self.supervisor.vacancies + sum(url in self.owned for url in failed)
        wait = none_loaded and self.launcher is not None and owed > 0
        if none_loaded and not wait and (results or not self.supervisor.vacancies):
            raise RuntimeError(f"no engine could load weight version {version}: {failed or 'the pool has no engines'}")
        for url, why in failed.items():
            # an engine that cannot take the new weights would serve stale ones: take it out of rotation
            log.warning("engine %s failed to load weight version %s (%s); removing it", url, version, why)
            if url in self.owned:
                await self.supervisor.retire(url, f"it failed to load weight version {version}")
            else:
                try:
                    await self.router.remove_engine(url, drain=False)
                except KeyError:
                    continue  # a supervision pass on the other thread took it out meanwhile
                self.removed.append(url)
        return failed if wait else None

    def _await_engine(self, deadline: float, what: str, errors: dict[str, Any]) -> None:
        """Supervision passes until an engine is routable (each admitted one serves the target
        version); NoEngineAvailable once ``deadline`` passed without one."""
        self.outages += 1
        start = time.monotonic()
        log.warning("no engine serving %s; waiting up to %.0f s for a replacement (%s)", what,
                    max(0.0, deadline - start), errors)
        while not _routable(self.engines()):
            if time.monotonic() >= deadline:
                raise NoEngineAvailable(
                    f"no engine serves {what}: none came up within {time.monotonic() - start:.0f} s of waiting "
                    f"(rollout.engine_timeout_s={self.outage_timeout_s:g}); errors: {errors}. Raise "
                    f"rollout.engine_timeout_s if engines take longer to start, or read the engine logs "
                    f"(runs/<run id>/logs/engines/ on a local root) for why they died or could not load weights")
            try:
                self.supervise()
            except Exception as e:  # reported if the wait fails; the next pass retries
                errors["supervision"] = e
                log.warning("engine supervision pass failed (%s); retrying", e)
            if not _routable(self.engines()):
                liveness.mark(liveness.WAITING)  # bounded by engine_timeout_s, not by the hang watch
                time.sleep(0.5)

    def weights_at(self, store: WeightStore, version: int) -> str:
        """What an engine is told to load: the version's URL, or (``local_weights``) its local folder."""
        url = store.version_url(version)
        if not self.local_weights:
            return url
        path = objstore.local_path(url)
        if path is None:
            raise RuntimeError(f"weight version {version} is at {url}, which these engines cannot read (SGLang loads "
                               f"a local folder): use a local or shared-filesystem root")
        return path

    # -- membership ----------------------------------------------------------------------------------
    def add_engine(self, url: str, store: WeightStore | None = None, process: LaunchedEngine | None = None) -> None:
        """Load the current weights into ``url`` first, then route to it (never serve stale weights).

        ``process``: the pool owns the engine (stops it on removal or close, replaces it when it
        dies). If the pool moved to a newer version while this engine loaded (a broadcast it was
        not part of yet), the newer one is loaded into it too, until it matches."""
        self.run(self.admit(url.rstrip("/"), store))
        if process is not None:
            self.owned[url.rstrip("/")] = process

    async def admit(self, url: str, store: WeightStore | None) -> None:
        """On the pool's loop: load the current weights into ``url``, then route to it."""
        async def load(version: int) -> None:
            client = EngineClient(url, retries=1)
            try:
                r = await client.update_weights_from_disk(self.weights_at(store, version), str(version))
            finally:
                await client.close()
            if not r.get("success"):
                raise RuntimeError(f"engine {url} could not load weight version {version}: {r}")

        loaded = self.target_version
        if store is not None and loaded >= 0:
            await load(loaded)
        # In the table but not routed to: a broadcast from now on reaches it, and one that started
        # before set the target version that is loaded here. No await between the last check and
        # mark_ready, so no request meets it on an older version than the pool's.
        await self.router.add_engine(url, ready=False)
        while store is not None and self.target_version != loaded:
            loaded = self.target_version
            await load(loaded)
        self.router.mark_ready(url)

    def remove_engines(self, urls: list[str], drain: bool = True,
                       timeout_s: float | None = 300.0) -> dict[str, BaseException | None]:
        """Stop routing to ``urls`` at once (so draining one does not push its share onto another
        about to drain), wait for their outstanding requests; per url None or the error. Owned
        engines that were removed are stopped (they are not replaced)."""
        async def all_of():
            return await asyncio.gather(*(self.router.remove_engine(u, drain=drain, timeout_s=timeout_s)
                                          for u in urls), return_exceptions=True)
        results = dict(zip(urls, self.run(all_of()), strict=True))
        for url, error in results.items():
            process = self.owned.pop(url.rstrip("/"), None) if error is None else None
            if process is not None:
                process.stop()
        return results

    def remove_engine(self, url: str, drain: bool = True, timeout_s: float | None = 300.0) -> None:
        error = self.remove_engines([url], drain, timeout_s)[url]
        if error is not None:
            raise error

    def engines(self) -> list[dict[str, Any]]:
        """The router's table, read on its own loop (which is where it changes)."""
        async def table() -> list[dict[str, Any]]:
            return self.router.engines()
        return self.run(table(), timeout=30)

    def fault_counts(self) -> dict[str, int]:
        """Counters for the rollout's metrics (cumulative over the pool's life)."""
        table = self.engines()
        return {"engine_retries": self.router.retries, "engine_unhealthy_marks": self.router.unhealthy_marks,
                "engines_replaced": self.replaced, "engines_healthy": _routable(table),
                "engine_outages": self.outages,
                **({"weights_broadcast": self.sync.pushed, "weight_broadcast_fallbacks": self.sync.fallbacks}
                   if self.sync is not None else {})}

    # -- supervision and shutdown ---------------------------------------------------------------------
    def supervise(self) -> dict[str, list[str]]:
        """One supervision pass (:meth:`EngineSupervisor.supervise`)."""
        return self.supervisor.supervise()

    def stop_owned(self) -> None:
        """Shutdown: stop supervising, then every engine process the pool owns (and any
        replacement being started)."""
        self.supervisor.stop()
        for url in list(self.owned):
            process = self.owned.pop(url, None)
            if process is not None:
                process.stop()

    def close(self) -> None:
        try:
            if self.sync is not None:
                self.run(self.sync.close(), timeout=30)
            self.stop_owned()
            self.supervisor.join(timeout=60)
            self.run(self.router.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _routable(table: list[dict[str, Any]]) -> int:
    """Engines of a router table that get requests."""
    return sum(e["healthy"] and e["ready"] and not e["draining"] for e in table)


def _shares(n: int, k: int) -> list[tuple[int, int]]:
    """``[start, end)`` of ``min(n, k)`` contiguous, near-equal shares of ``n`` items (larger first)."""
    if n == 0:
        return []
    k = max(1, min(n, k))
    bounds = [i * (n // k) + min(i, n % k) for i in range(k + 1)]
    return list(zip(bounds, bounds[1:], strict=False))


def _request_bytes(p: EncodedPrompt) -> int:
    """An upper bound of what prompt ``p`` adds to a ``/generate`` body (ids as JSON, media as base64)."""
    return 8 * len(p.input_ids) + sum(4 * len(b) // 3 + 32 for b in [*p.images, *p.audios]) + 512


def _by_size(sizes: list[int], limit: int) -> list[tuple[int, int]]:
    """``[start, end)`` runs of consecutive items whose sizes add up to at most ``limit`` (an item
    over it alone); the same sizes always give the same runs."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > limit:
            runs.append((start, i))
            start, total = i, 0
        total += size
    return [*runs, (start, len(sizes))] if sizes else []


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _completion(rid: str, index: int, item: dict[str, Any], prompt_tokens: int) -> Completion:
    meta = item.get("meta_info", {})
    lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    ids = [int(t) for t in item.get("output_ids", [])]
    if len(lps) != len(ids):
        raise ValueError(f"engine answered {len(ids)} tokens with {len(lps)} logprobs for request {rid}")
    return Completion(
        rid,
        index,
        ids,
        lps,
        meta.get("finish_reason") or {},
        prompt_tokens,
        str(meta.get("weight_version", "-1")),
        top_logprobs=[[(float(e[0]), int(e[1])) for e in row] for row in top] if (top := meta.get(
            "output_top_logprobs")) else None,
        routed_experts=routes_from_wire(meta.get("routed_experts"), rid),
    )

