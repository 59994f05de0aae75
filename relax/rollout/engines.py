"""The engines a rollout drives, behind one small interface.

* :class:`LocalEngines` — a native engine in the rollout's own process, driven on the
  rollout's thread (no HTTP, no second compute thread: the fastest path on a CPU).
* :class:`RemoteEngines` — any number of SGLang-compatible URLs (native servers, real SGLang)
  behind :class:`relax.engines.router.Router`: least-loaded routing, fail-over when an engine
  dies or answers garbage, engines added and removed at runtime by the elastic REST API, and
  engine processes it owns replaced when they die (:meth:`RemoteEngines.supervise`).

Both return, per prompt, its ``n`` :class:`~relax.engines.types.Completion` objects, each
carrying the weight version that produced it, and load WeightStore versions in place.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import logging
import threading
from collections.abc import Callable
from typing import Any, Protocol

import torch

from relax.engines.client import EngineClient
from relax.engines.native.engine import NativeEngine
from relax.engines.router import Router
from relax.engines.types import Completion, GenerateRequest, SamplingParams
from relax.rollout.prompts import EncodedPrompt
from relax.transfer.weights import WeightStore

log = logging.getLogger(__name__)


class EnginePool(Protocol):
    """What the rollout needs from its engines."""

    weight_version: int

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        """Completions per prompt; ``should_abort()`` polled during generation stops it early
        (finish_reason ``abort``, partial tokens kept) so new weights can be loaded."""
        ...

    def load_weights(self, store: WeightStore, version: int) -> None: ...

    def close(self) -> None: ...


class LocalEngines:
    """A :class:`NativeEngine` on the calling thread."""

    def __init__(self, model: torch.nn.Module, tokenizer: Any, max_batch_size: int, max_seq_len: int, seed: int):
        self.engine = NativeEngine(model, tokenizer, max_batch_size=max_batch_size, max_seq_len=max_seq_len,
                                   seed=seed, background=False, weight_version="-1")
        self.weight_version = -1

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        futures = [self.engine.submit(GenerateRequest(rid, p.input_ids, sp, p.mm_inputs))
                   for p, sp, rid in zip(prompts, params, rids, strict=True)]
        steps = 0
        while self.engine.step():
            steps += 1
            if should_abort is not None and steps % 4 == 0 and should_abort():
                for rid in rids:
                    self.engine.abort(rid)
                while self.engine.step():
                    pass
                break
        return [f.result() for f in futures]

    def load_weights(self, store: WeightStore, version: int) -> None:
        state, _ = store.load(version)
        self.engine.update_weights(state, str(version))
        self.weight_version = version

    def close(self) -> None:
        self.engine.stop()


class LaunchedEngine(Protocol):
    """What the pool keeps of an engine it owns: where it serves, whether its process still
    runs (the supervisor replaces it once it does not), how to stop it."""

    @property
    def url(self) -> str: ...

    @property
    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class EngineLauncher(Protocol):
    """``launch(n)`` starts ``n`` healthy engines or raises (relax.services.engine_launcher:
    LocalProcessLauncher, and its CapacityError when refused)."""

    def launch(self, n: int) -> list[LaunchedEngine]: ...


class RemoteEngines:
    """SGLang-compatible engines by URL; a private event loop thread runs the async router.

    Engines come in two kinds. *External* ones (plain URLs) are routed around when they fail
    and routed to again once they answer ``/health`` with the current weights; nothing here
    can restart them. *Owned* ones (``owned``, or ``add_engine(..., process=...)``) are
    processes this pool stops on close; :meth:`supervise` replaces one whose process exited
    or that the router marked unhealthy with a fresh one from ``launcher``, which loads the
    current weight version from the WeightStore before it gets traffic. With
    ``supervise_interval_s > 0`` a background thread runs :meth:`supervise` that often.
    """

    def __init__(self, urls: list[str], timeout_s: float = 120.0, *, owned: list[LaunchedEngine] | None = None,
                 launcher: EngineLauncher | None = None, store: WeightStore | None = None, max_failures: int = 3,
                 vocab_size: int | None = None, supervise_interval_s: float = 0.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relax-rollout-http", daemon=True)
        self._thread.start()
        self.owned: dict[str, LaunchedEngine] = {e.url.rstrip("/"): e for e in owned or []}
        urls = list(dict.fromkeys([*(u.rstrip("/") for u in urls), *self.owned]))
        self.router: Router = self.run(self._make_router(urls, timeout_s=timeout_s, max_failures=max_failures,
                                                         vocab_size=vocab_size))
        self.launcher, self.store = launcher, store
        self.weight_version = -1
        self._target_version = -1  # the version being loaded: engines added meanwhile load it too
        self.removed: list[str] = []  # external engines dropped after refusing new weights
        self.replaced = 0  # owned engines replaced by supervise()
        self._vacancies = 0  # owned engines retired and not replaced yet (a failed launch is retried)
        self._supervise_lock = threading.Lock()
        self._stop = threading.Event()
        self._supervisor: threading.Thread | None = None
        if supervise_interval_s > 0:
            self._supervisor = threading.Thread(target=self._supervise_forever, args=(supervise_interval_s,),
                                                name="relax-engine-supervisor", daemon=True)
            self._supervisor.start()

    @staticmethod
    async def _make_router(urls: list[str], **kwargs: Any) -> Router:
        return Router(urls, **kwargs)  # built on the loop that will use its clients

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the pool's loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _one(self, p: EncodedPrompt, sp: SamplingParams, rid: str) -> list[Completion]:
        params = dataclasses.asdict(sp)  # the same names as SGLang's sampling_params
        if not params["forced_output_ids"]:
            del params["forced_output_ids"]  # native engines only; SGLang would refuse the unknown key
        # media goes as bytes beside the already expanded ids (docs/engines.md, "Media"): the
        # engine rebuilds the same tensors, and the tokens trained on are the ones it saw
        media = {"image_data": [_data_uri(b, "image/png") for b in p.images] or None,
                 "audio_data": [_data_uri(b, "audio/wav") for b in p.audios] or None}
        out = await self.router.generate(input_ids=p.input_ids, sampling_params=params, return_logprob=True, rid=rid,
                                         **media)
        items = out if isinstance(out, list) else [out]
        return [_completion(rid, i, item, len(p.input_ids)) for i, item in enumerate(items)]

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        async def all_of():
            return await asyncio.gather(*(self._one(p, sp, rid) for p, sp, rid in zip(prompts, params, rids,
                                                                                        strict=True)))
        return self.run(all_of())

    # -- weights -----------------------------------------------------------------------------------
    def load_weights(self, store: WeightStore, version: int) -> None:
        self.store = store
        self.run(self._load_all(store, version))

    async def _load_all(self, store: WeightStore, version: int) -> None:
        self._target_version = version  # set before the broadcast snapshots the engines (see _add)
        results = await self.router.broadcast("update_weights_from_disk", store.version_url(version), str(version))
        failed = {u: r for u, r in results.items() if isinstance(r, Exception) or not r.get("success")}
        if len(failed) == len(results) and (results or not self._vacancies):
            raise RuntimeError(f"no engine could load weight version {version}: {failed or 'the pool has no engines'}")
        for url, why in failed.items():
            # an engine that cannot take the new weights would serve stale ones: take it out of rotation
            log.warning("engine %s failed to load weight version %s (%s); removing it", url, version, why)
            if url in self.owned:
                await self._retire(url, f"it failed to load weight version {version}")
            else:
                try:
                    await self.router.remove_engine(url, drain=False)
                except KeyError:
                    continue  # a supervision pass on the other thread took it out meanwhile
                self.removed.append(url)
        self.weight_version = version

    # -- membership ----------------------------------------------------------------------------------
    def add_engine(self, url: str, store: WeightStore | None = None, process: LaunchedEngine | None = None) -> None:
        """Load the current weights into ``url`` first, then route to it (never serve stale weights).

        ``process``: the pool owns the engine (stops it on removal or close, replaces it when it
        dies). If the pool moved to a newer version while this engine loaded (a broadcast it was
        not part of yet), the newer one is loaded into it too, until it matches."""
        self.run(self._add(url.rstrip("/"), store))
        if process is not None:
            self.owned[url.rstrip("/")] = process

    async def _add(self, url: str, store: WeightStore | None) -> None:
        async def load(version: int) -> None:
            client = EngineClient(url, retries=1)
            try:
                r = await client.update_weights_from_disk(store.version_url(version), str(version))
            finally:
                await client.close()
            if not r.get("success"):
                raise RuntimeError(f"engine {url} could not load weight version {version}: {r}")

        loaded = self._target_version
        if store is not None and loaded >= 0:
            await load(loaded)
        # In the table but not routed to: a broadcast from now on reaches it, and one that started
        # before set the target version that is loaded here. No await between the last check and
        # mark_ready, so no request meets it on an older version than the pool's.
        await self.router.add_engine(url, ready=False)
        while store is not None and self._target_version != loaded:
            loaded = self._target_version
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
                "engines_replaced": self.replaced, "engines_healthy": sum(e["healthy"] and e["ready"] and not e["draining"] for e in table)}

    # -- supervision ---------------------------------------------------------------------------------
    def supervise(self) -> dict[str, list[str]]:
        """One pass: replace owned engines that died or turned unhealthy, bring back external ones
        that answer again. Returns ``{"retired": [...], "added": [...], "revived": [...]}``."""
        with self._supervise_lock:
            return self.run(self._supervise())

    def _supervise_forever(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.supervise()
            except Exception:  # the next pass retries; a supervisor that dies would leave dead engines
                log.exception("engine supervision pass failed; retrying in %.1f s", interval_s)

    async def _supervise(self) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {"retired": [], "added": [], "revived": []}
        table = {e["url"]: e for e in self.router.engines()}
        for url, process in list(self.owned.items()):
            e = table.get(url)
            if e is None or e["draining"]:
                continue  # being removed by its owner (a scale-in), not ours to replace
            if not process.alive:
                why = "its process exited"
            elif not e["healthy"]:
                why = f"it is unhealthy ({e['failures']} failures; last: {e['last_error'] or 'no answer'})"
            else:
                continue
            await self._retire(url, why)
            out["retired"].append(url)
        out["added"] = await self._fill_vacancies()
        for e in self.router.engines():  # read again: the retired engines are gone from it
            url = e["url"]
            if url not in self.owned and not e["healthy"] and not e["draining"] and await self._revive(url):
                out["revived"].append(url)
        return out

    async def _retire(self, url: str, why: str) -> None:
        """Take an owned engine out of rotation and stop it; a replacement is owed (a vacancy)."""
        process = self.owned.pop(url, None)
        if process is None:
            return  # retired already (a failed weight load and a supervision pass can both find it)
        if self.launcher is None:
            log.warning("owned engine %s is out of rotation: %s; no launcher to replace it", url, why)
        else:
            log.warning("replacing owned engine %s: %s", url, why)
        remover = asyncio.ensure_future(self.router.remove_engine(url, drain=True, timeout_s=60))
        await asyncio.sleep(0)  # the removal marks it draining first: no new requests go to it
        await asyncio.to_thread(process.stop)  # requests still on it fail and move to other engines
        try:
            await remover
        except KeyError:
            pass  # already removed
        except asyncio.TimeoutError:
            await self.router.remove_engine(url, drain=False)
        self._vacancies += 1

    async def _fill_vacancies(self) -> list[str]:
        added: list[str] = []
        while self._vacancies and self.launcher is not None and not self._stop.is_set():
            try:
                [process] = await asyncio.to_thread(self.launcher.launch, 1)
            except Exception as e:
                log.warning("could not start a replacement engine (%s: %s); the next pass retries", type(e).__name__, e)
                break
            url = process.url.rstrip("/")
            try:
                await self._add(url, self.store)  # the current weights first, then traffic
            except Exception as e:
                await asyncio.to_thread(process.stop)
                log.warning("replacement engine %s did not come up (%s); the next pass retries", url, e)
                break
            self.owned[url] = process
            self._vacancies -= 1
            self.replaced += 1
            added.append(url)
        return added

    async def _revive(self, url: str) -> bool:
        """Route to an external engine again once it answers /health and serves (or loads) the
        current weights: an engine that restarted holds its initial ones."""
        try:
            client = self.router.client(url)
        except KeyError:
            return False  # removed meanwhile (a scale-in)
        if not await client.health():
            return False
        version = self._target_version
        if version >= 0:
            try:
                info = await client.model_info()
                if str(info.get("weight_version")) != str(version):
                    if self.store is None:
                        return False
                    r = await client.update_weights_from_disk(self.store.version_url(version), str(version))
                    if not r.get("success"):
                        return False
            except Exception as e:  # still broken: stays out of rotation, the next pass retries
                log.info("engine %s answers /health but not its weight check (%s)", url, e)
                return False
        if self._target_version != version:
            return False  # the pool moved on while it loaded; the next pass checks again
        self.router.mark_healthy(url)
        log.warning("engine %s is healthy again with weight version %s; routing to it", url, version)
        return True

    def stop_owned(self) -> None:
        """Shutdown: stop supervising, then every engine process the pool owns (and any
        replacement being started)."""
        self._stop.set()
        stop_all = getattr(self.launcher, "stop_all", None)
        if stop_all is not None:
            stop_all()
        for url in list(self.owned):
            process = self.owned.pop(url, None)
            if process is not None:
                process.stop()

    def close(self) -> None:
        try:
            self.stop_owned()
            if self._supervisor is not None:
                self._supervisor.join(timeout=60)
            self.run(self.router.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode("ascii")


def _completion(rid: str, index: int, item: dict[str, Any], prompt_tokens: int) -> Completion:
    meta = item.get("meta_info", {})
    lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    ids = [int(t) for t in item.get("output_ids", [])]
    if len(lps) != len(ids):
        raise ValueError(f"engine answered {len(ids)} tokens with {len(lps)} logprobs for request {rid}")
    return Completion(rid, index, ids, lps, meta.get("finish_reason") or {}, prompt_tokens,
                      str(meta.get("weight_version", "-1")))

