"""EngineClient retry policy against a tiny real FastAPI app on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from relax.engines.client import EngineClient, EngineHTTPError, EngineUnavailable
from tests.relax.engines.contract import InProcessServer, free_port


def flaky_app() -> tuple[FastAPI, dict[str, int]]:
    calls = {"generate": 0, "bad": 0, "busy": 0}
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict:
        return {}

    @app.post("/generate")
    async def generate(body: dict) -> JSONResponse:
        calls["generate"] += 1
        if calls["generate"] <= 2:
            return JSONResponse({"error": {"message": "warming up"}}, status_code=503)
        return JSONResponse({"text": "ok", "output_ids": [1], "meta_info": {"id": body.get("rid", "x")}})

    @app.post("/bad")
    async def bad() -> JSONResponse:
        calls["bad"] += 1
        return JSONResponse({"error": {"message": "top_p must be in (0, 1]"}}, status_code=400)

    @app.post("/busy")
    async def busy() -> JSONResponse:
        calls["busy"] += 1
        return JSONResponse({"error": {"message": "too many requests"}}, status_code=429)

    @app.post("/slow")
    async def slow() -> dict:
        await asyncio.sleep(2)
        return {}

    return app, calls


@pytest.fixture(scope="module")
def flaky():
    app, calls = flaky_app()
    with InProcessServer(app) as srv:
        yield srv.url, calls


def test_retries_503_then_succeeds(flaky) -> None:
    url, calls = flaky
    calls["generate"] = 0

    async def go() -> dict:
        async with EngineClient(url, timeout_s=5, retries=3, backoff_s=0.01) as c:
            r = await c.generate(input_ids=[1, 2], rid="abc")
            assert c.outstanding == 0
            return r

    assert asyncio.run(go())["meta_info"]["id"] == "abc"
    assert calls["generate"] == 3


def test_no_retry_on_400_and_server_message(flaky) -> None:
    url, calls = flaky
    calls["bad"] = 0

    async def go() -> None:
        async with EngineClient(url, timeout_s=5, retries=3, backoff_s=0.01) as c:
            await c.request("POST", "/bad", {})

    with pytest.raises(EngineHTTPError, match="top_p must be") as e:
        asyncio.run(go())
    assert e.value.status == 400 and calls["bad"] == 1


def test_429_retried_then_raised(flaky) -> None:
    url, calls = flaky
    calls["busy"] = 0

    async def go() -> None:
        async with EngineClient(url, timeout_s=5, retries=2, backoff_s=0.01) as c:
            await c.request("POST", "/busy", {})

    with pytest.raises(EngineHTTPError) as e:
        asyncio.run(go())
    assert e.value.status == 429 and calls["busy"] == 3


def test_connection_refused_is_unavailable_after_retries() -> None:
    async def go() -> None:
        async with EngineClient(f"http://127.0.0.1:{free_port()}", timeout_s=2, retries=2, backoff_s=0.01) as c:
            assert await c.health() is False
            await c.generate(input_ids=[1])

    with pytest.raises(EngineUnavailable):
        asyncio.run(go())


def test_per_request_timeout(flaky) -> None:
    url, _ = flaky

    async def go() -> None:
        async with EngineClient(url, timeout_s=0.3, retries=0) as c:
            await c.request("POST", "/slow", {})

    t0 = time.monotonic()
    with pytest.raises(asyncio.TimeoutError):
        asyncio.run(go())
    assert time.monotonic() - t0 < 1.5
