"""The engines a rollout drives, behind one small interface.

* :class:`LocalEngines` — a native engine in the rollout's own process, driven on the
  rollout's thread (no HTTP, no second compute thread: the fastest path on a CPU).
* :class:`RemoteEngines` — any number of SGLang-compatible URLs (native servers, real SGLang)
  behind :class:`relax.engines.router.Router`: least-loaded routing, fail-over when an engine
  dies, engines added and removed at runtime by the elastic REST API.

Both return, per prompt, its ``n`` :class:`~relax.engines.types.Completion` objects, each
carrying the weight version that produced it, and load WeightStore versions in place.
"""

from __future__ import annotations

import asyncio
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


class RemoteEngines:
    """SGLang-compatible engines by URL; a private event loop thread runs the async router."""

    def __init__(self, urls: list[str], timeout_s: float = 120.0):
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="relax-rollout-http", daemon=True)
        self._thread.start()
        self.router: Router = self.run(self._make_router(urls, timeout_s))
        self.weight_version = -1
        self.removed: list[str] = []  # engines dropped after failing (dead, or refused new weights)

    @staticmethod
    async def _make_router(urls: list[str], timeout_s: float) -> Router:
        return Router(urls, timeout_s=timeout_s)  # built on the loop that will use its clients

    def run(self, coro: Any, timeout: float | None = None) -> Any:
        """Run a coroutine on the pool's loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    async def _one(self, p: EncodedPrompt, sp: SamplingParams, rid: str) -> list[Completion]:
        params = dataclasses.asdict(sp)  # the same names as SGLang's sampling_params
        if p.images or p.audios:
            raise NotImplementedError("remote engines take text prompts here; send media through the "
                                      "OpenAI chat route or use local engines for media tasks")
        out = await self.router.generate(input_ids=p.input_ids, sampling_params=params, return_logprob=True, rid=rid)
        items = out if isinstance(out, list) else [out]
        return [_completion(rid, i, item, len(p.input_ids)) for i, item in enumerate(items)]

    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams], rids: list[str],
                 should_abort: Callable[[], bool] | None = None) -> list[list[Completion]]:
        async def all_of():
            return await asyncio.gather(*(self._one(p, sp, rid) for p, sp, rid in zip(prompts, params, rids,
                                                                                        strict=True)))
        return self.run(all_of())

    def load_weights(self, store: WeightStore, version: int) -> None:
        results = self.run(self.router.broadcast("update_weights_from_disk", store.version_url(version), str(version)))
        failed = {u: r for u, r in results.items() if isinstance(r, Exception) or not r.get("success")}
        if len(failed) == len(results):
            raise RuntimeError(f"no engine could load weight version {version}: {failed}")
        for url, why in failed.items():
            # an engine that cannot take the new weights would serve stale ones: take it out of rotation
            log.warning("engine %s failed to load weight version %s (%s); removing it", url, version, why)
        self.remove_engines(list(failed), drain=False)
        self.removed += list(failed)
        self.weight_version = version

    def add_engine(self, url: str, store: WeightStore | None = None) -> None:
        """Load the current weights into ``url`` first, then route to it (never serve stale weights).

        If the pool moved to a newer version while this engine loaded (a broadcast it was not part
        of yet), the newer one is loaded into it too, until it matches."""
        async def load(version: int) -> None:
            client = EngineClient(url, retries=1)
            try:
                r = await client.update_weights_from_disk(store.version_url(version), str(version))
            finally:
                await client.close()
            if not r.get("success"):
                raise RuntimeError(f"engine {url} could not load weight version {version}: {r}")

        async def add() -> None:
            loaded = self.weight_version
            if store is not None and loaded >= 0:
                await load(loaded)
            await self.router.add_engine(url)
            while store is not None and self.weight_version != loaded:
                loaded = self.weight_version
                await load(loaded)
        self.run(add())

    def remove_engines(self, urls: list[str], drain: bool = True,
                       timeout_s: float | None = 300.0) -> dict[str, BaseException | None]:
        """Stop routing to ``urls`` at once (so draining one does not push its share onto another
        about to drain), wait for their outstanding requests; per url None or the error."""
        async def all_of():
            return await asyncio.gather(*(self.router.remove_engine(u, drain=drain, timeout_s=timeout_s)
                                          for u in urls), return_exceptions=True)
        return dict(zip(urls, self.run(all_of()), strict=True))

    def remove_engine(self, url: str, drain: bool = True, timeout_s: float | None = 300.0) -> None:
        error = self.remove_engines([url], drain, timeout_s)[url]
        if error is not None:
            raise error

    def engines(self) -> list[dict[str, Any]]:
        """The router's table, read on its own loop (which is where it changes)."""
        async def table() -> list[dict[str, Any]]:
            return self.router.engines()
        return self.run(table(), timeout=30)

    def close(self) -> None:
        try:
            self.run(self.router.close(), timeout=10)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)


def _completion(rid: str, index: int, item: dict[str, Any], prompt_tokens: int) -> Completion:
    meta = item.get("meta_info", {})
    lps = [float(x[0]) for x in meta.get("output_token_logprobs") or []]
    ids = [int(t) for t in item.get("output_ids", [])]
    if len(lps) != len(ids):
        raise ValueError(f"engine answered {len(ids)} tokens with {len(lps)} logprobs for request {rid}")
    return Completion(rid, index, ids, lps, meta.get("finish_reason") or {}, prompt_tokens,
                      str(meta.get("weight_version", "-1")))

