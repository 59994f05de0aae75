"""Async client of one engine URL (the native server or a real SGLang server).

Why retries live here: rollout workers talk to engines that restart, are being added or
drained, or are briefly overloaded. Connection errors, 5xx and 429 are transient and are
retried with exponential backoff; a 4xx is the caller's mistake and is raised at once with
the server's own message, so a bad sampling parameter never turns into a minute of retries.

Why ``/generate`` answers are validated here: a broken engine (bad weights, a buggy build, a
proxy answering in its place) can answer 200 with garbage, and garbage that reaches the
rollout becomes training data. A malformed answer raises :class:`EngineBadResponse` and a
request that runs past ``timeout_s`` raises :class:`EngineTimeout`; neither is retried on the
same engine (the router re-sends the request to another one and counts the failure).

Built on aiohttp (already a dependency through s3fs) rather than httpx.
"""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import aiohttp

from relax.engines.guards import token_from_env


class EngineHTTPError(RuntimeError):
    """The engine answered with an error status; ``message`` is the server's own message."""

    def __init__(self, status: int, message: str, body: Any = None, url: str = ""):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.body, self.url = status, message, body, url


class EngineUnavailable(ConnectionError):
    """The engine could not be reached (refused, reset, died mid-request) after all retries."""


class EngineBadResponse(RuntimeError):
    """The engine answered 2xx with a body that is not a valid answer (the message says what is wrong)."""


class EngineTimeout(TimeoutError):
    """The engine did not answer within the request timeout (an ``asyncio.TimeoutError`` too)."""


def _message(body: Any) -> str:
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        if "message" in body:
            return str(body["message"])
    return str(body)[:2000]


class EngineClient:
    """``await client.generate(input_ids=[...], sampling_params={...})`` and the control routes.

    ``timeout_s`` bounds each HTTP attempt; ``retries`` is the number of extra attempts after
    the first; the k-th retry waits ``backoff_s * 2**k`` (or the server's Retry-After on 429).
    ``outstanding`` counts requests in flight, which the router balances on. ``vocab_size``, when
    known, lets :meth:`generate` refuse token ids the model cannot have produced.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5,
                 vocab_size: int | None = None, token: str | None = None):
        self.url = url.rstrip("/")
        # the engines' bearer token (relax.engines.guards): given, or the run's RELAX_ENGINE_TOKEN
        self.token = token if token is not None else token_from_env()
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.vocab_size = vocab_size
        self.outstanding = 0
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session._loop is not loop:
            headers = {"Authorization": f"Bearer {self.token}"} if self.token else None
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s), headers=headers)
        return self._session

    async def close(self) -> None:
        if self._session is not None and not self._session.closed:
            await self._session.close()
        self._session = None

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def request(self, method: str, path: str, payload: Any = None, *, retries: int | None = None,
                      timeout_s: float | None = None) -> Any:
        """One call with retries; returns parsed JSON, the text body, or None for an empty body."""
        attempts = 1 + (self.retries if retries is None else retries)
        timeout = aiohttp.ClientTimeout(total=timeout_s or self.timeout_s)
        last: Exception | None = None
        for attempt in range(attempts):
            wait = self.backoff_s * 2**attempt
            try:
                async with self._get_session().request(method, self.url + path, json=payload, timeout=timeout) as r:
                    raw = await r.text()
                    try:
                        body = json.loads(raw) if raw else None
                    except json.JSONDecodeError:
                        body = raw
                    if r.status < 400:
                        return body
                    last = EngineHTTPError(r.status, _message(body), body, self.url + path)
                    if r.status < 500 and r.status != 429:
                        raise last
                    if r.status == 429 and r.headers.get("Retry-After", "").isdigit():
                        wait = max(wait, float(r.headers["Retry-After"]))
            except aiohttp.ConnectionTimeoutError as e:  # never connected: unreachable, not slow
                last = EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}")
            except asyncio.TimeoutError:
                # not retried here: an engine that took timeout_s once is likely stuck, and the
                # router re-sends the request to another engine
                raise EngineTimeout(f"{self.url}{path}: no answer within {timeout.total:g} s; raise the client's "
                                    f"timeout_s if requests are legitimately this slow") from None
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}")
            if attempt + 1 < attempts:
                await asyncio.sleep(min(wait, 30.0))
        assert last is not None
        raise last

    async def generate(
        self,
        input_ids: list[int] | list[list[int]] | None = None,
        *,
        text: str | list[str] | None = None,
        sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
        return_logprob: bool = False,
        image_data: Any = None,
        audio_data: Any = None,
        rid: str | list[str] | None = None,
        **extra: Any,
    ) -> Any:
        """SGLang ``/generate``: a dict for one prompt (n=1), else a list of dicts."""
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob, **extra}
        for key, value in (("input_ids", input_ids), ("text", text), ("image_data", image_data),
                           ("audio_data", audio_data), ("rid", rid)):
            if value is not None:
                payload[key] = value
        self.outstanding += 1
        try:
            body = await self.request("POST", "/generate", payload)
        finally:
            self.outstanding -= 1
        if not payload.get("stream"):  # a stream is SSE text; its consumer parses it
            check_generate_response(body, payload, self.vocab_size, self.url)
        return body

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        body = await self.request("POST", "/v1/chat/completions", {"messages": messages, **params})
        if not params.get("stream") and not (isinstance(body, dict) and isinstance(body.get("choices"), list)):
            raise EngineBadResponse(f"{self.url}/v1/chat/completions answered without a 'choices' list: "
                                    f"{str(body)[:200]!r}")
        return body

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True iff ``GET /health`` answers 200 within ``timeout_s``; never retries, never raises."""
        try:
            await self.request("GET", "/health", retries=0, timeout_s=timeout_s)
            return True
        except (EngineHTTPError, EngineUnavailable, EngineBadResponse, asyncio.TimeoutError):
            return False

    async def health_generate(self, timeout_s: float = 30.0) -> bool:
        try:
            await self.request("GET", "/health_generate", retries=0, timeout_s=timeout_s)
            return True
        except (EngineHTTPError, EngineUnavailable, asyncio.TimeoutError):
            return False

    async def model_info(self) -> dict[str, Any]:
        return await self.request("GET", "/get_model_info")

    async def flush_cache(self) -> bool:
        """False when the engine refuses (SGLang: 400 while requests are running)."""
        try:
            await self.request("POST", "/flush_cache")
            return True
        except EngineHTTPError as e:
            if e.status == 400:
                return False
            raise

    async def abort(self, rid: str = "", abort_all: bool = False) -> None:
        await self.request("POST", "/abort_request", {"rid": rid, "abort_all": abort_all})

    async def _control(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Weight routes answer ``{success, message}``; a 400 with that shape is returned, not raised."""
        try:
            return await self.request("POST", path, payload)
        except EngineHTTPError as e:
            if isinstance(e.body, dict) and "success" in e.body:
                return e.body
            raise

    async def update_weights_from_disk(self, path: str, version: str | None = None, *,
                                       flush_cache: bool = True) -> dict[str, Any]:
        """``{success, message}``; on failure the engine keeps serving its previous weights."""
        payload: dict[str, Any] = {"model_path": path, "flush_cache": flush_cache}
        if version is not None:
            payload["weight_version"] = str(version)
        return await self._control("/update_weights_from_disk", payload)

    async def load_lora_adapter(self, name: str, path: str) -> dict[str, Any]:
        """SGLang's ``/load_lora_adapter`` (a server started with ``--enable-lora``): the PEFT folder at
        ``path`` served as ``name`` (requests then pick it by ``lora_path``); ``{success, message}``."""
        return await self._control("/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str = "weight_update_group",
                                        backend: str = "nccl") -> dict[str, Any]:
        return await self._control("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend})

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              group_name: str = "weight_update_group",
                                              weight_version: str | None = None,
                                              flush_cache: bool = True) -> dict[str, Any]:
        payload: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)
        return await self._control("/update_weights_from_distributed", payload)


def _prompt_count(payload: dict[str, Any]) -> int:
    """How many prompts a /generate payload carries (a batch is a list of texts or of id lists)."""
    text, ids = payload.get("text"), payload.get("input_ids")
    if isinstance(text, list):
        return len(text)
    if isinstance(ids, list) and ids and isinstance(ids[0], list):
        return len(ids)
    return 1


def check_generate_response(body: Any, payload: dict[str, Any], vocab_size: int | None, url: str = "") -> None:
    """Raise :class:`EngineBadResponse` unless ``body`` is a well-formed SGLang ``/generate`` answer
    to ``payload``: one item per prompt and sample, each with ``meta_info`` and integer
    ``output_ids`` (inside the vocabulary when ``vocab_size`` is known) and, when logprobs were
    asked for, one finite logprob per output token naming that token."""
    def bad(why: str) -> EngineBadResponse:
        return EngineBadResponse(f"{url}/generate answered a malformed response ({why}); the engine is "
                                 f"misbehaving: check its log, or restart/replace it")

    if isinstance(body, str) or body is None:
        raise bad(f"not JSON: {str(body)[:200]!r}")
    items = body if isinstance(body, list) else [body]
    sps = payload.get("sampling_params") or {}
    per_prompt = [int(sp.get("n") or 1) for sp in (sps if isinstance(sps, list) else [sps] * _prompt_count(payload))]
    if len(items) != sum(per_prompt) or (not isinstance(body, list) and sum(per_prompt) != 1):
        raise bad(f"{len(items)} item(s) for {len(per_prompt)} prompt(s) x n={per_prompt}")
    for i, item in enumerate(items):
        if not isinstance(item, dict) or not isinstance(item.get("meta_info"), dict):
            raise bad(f"item {i} has no 'meta_info' object: {str(item)[:200]!r}")
        ids = item.get("output_ids")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise bad(f"item {i} has no integer 'output_ids' list: {str(ids)[:200]!r}")
        if vocab_size is not None and any(not 0 <= t < vocab_size for t in ids):
            raise bad(f"item {i} has token ids outside the vocabulary [0, {vocab_size}): "
                      f"{[t for t in ids if not 0 <= t < vocab_size][:5]}")
        if not payload.get("return_logprob"):
            continue
        lps = item["meta_info"].get("output_token_logprobs")
        if not isinstance(lps, list) or len(lps) != len(ids):
            n = len(lps) if isinstance(lps, list) else "no"
            raise bad(f"item {i} has {len(ids)} output ids but {n} output_token_logprobs")
        for j, (entry, tok) in enumerate(zip(lps, ids, strict=True)):
            ok = isinstance(entry, (list, tuple)) and len(entry) >= 2 and isinstance(entry[0], (int, float))
            if not ok or not math.isfinite(entry[0]) or entry[0] > 1e-4 or entry[1] != tok:
                raise bad(f"item {i} token {j}: logprob entry {str(entry)[:100]!r} is not [finite logprob <= 0, "
                          f"token id {tok}, ...]")
