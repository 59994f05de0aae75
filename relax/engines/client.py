"""Async client of one engine URL (the native server or a real SGLang server).

Why retries live here: rollout workers talk to engines that restart, are being added or
drained, or are briefly overloaded. Connection errors, 5xx and 429 are transient and are
retried with exponential backoff; a 4xx is the caller's mistake and is raised at once with
the server's own message, so a bad sampling parameter never turns into a minute of retries.

Built on aiohttp (already a dependency through s3fs) rather than httpx.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp


class EngineHTTPError(RuntimeError):
    """The engine answered with an error status; ``message`` is the server's own message."""

    def __init__(self, status: int, message: str, body: Any = None, url: str = ""):
        super().__init__(f"{url}: HTTP {status}: {message}")
        self.status, self.message, self.body, self.url = status, message, body, url


class EngineUnavailable(ConnectionError):
    """The engine could not be reached (refused, reset, died mid-request) after all retries."""


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
    ``outstanding`` counts requests in flight, which the router balances on.
    """

    def __init__(self, url: str, timeout_s: float = 600.0, retries: int = 3, backoff_s: float = 0.5):
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self.outstanding = 0
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session._loop is not loop:
            self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s))
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
            except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
                last = EngineUnavailable(f"{self.url}{path}: {type(e).__name__}: {e}")
            if attempt + 1 < attempts:
                await asyncio.sleep(min(wait, 30.0))
        assert last is not None
        raise last

    async def generate(self, input_ids: list[int] | list[list[int]] | None = None, *, text: str | list[str] | None = None,
                       sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None,
                       return_logprob: bool = False, image_data: Any = None, audio_data: Any = None,
                       rid: str | list[str] | None = None, **extra: Any) -> Any:
        """SGLang ``/generate``: a dict for one prompt (n=1), else a list of dicts."""
        payload: dict[str, Any] = {"sampling_params": sampling_params or {}, "return_logprob": return_logprob, **extra}
        for key, value in (("input_ids", input_ids), ("text", text), ("image_data", image_data),
                           ("audio_data", audio_data), ("rid", rid)):
            if value is not None:
                payload[key] = value
        self.outstanding += 1
        try:
            return await self.request("POST", "/generate", payload)
        finally:
            self.outstanding -= 1

    async def chat(self, messages: list[dict[str, Any]], **params: Any) -> dict[str, Any]:
        return await self.request("POST", "/v1/chat/completions", {"messages": messages, **params})

    async def health(self, timeout_s: float = 5.0) -> bool:
        """True iff ``GET /health`` answers 200 within ``timeout_s``; never retries, never raises."""
        try:
            await self.request("GET", "/health", retries=0, timeout_s=timeout_s)
            return True
        except (EngineHTTPError, EngineUnavailable, asyncio.TimeoutError):
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
