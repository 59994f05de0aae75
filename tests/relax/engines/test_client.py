"""EngineClient retry policy and answer validation against tiny real FastAPI apps on loopback."""

from __future__ import annotations

import asyncio
import time

import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse

from relax.engines.client import (
    EngineBadResponse,
    EngineClient,
    EngineHTTPError,
    EngineTimeout,
    EngineUnavailable,
)
from tests.relax.engines.contract import InProcessServer, free_port
from tests.relax.engines.faulty_engine import GARBAGE, VOCAB, faulty_app

SLOW_S = 4.0  # how long /slow takes to answer


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
        await asyncio.sleep(SLOW_S)
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

    async def go() -> BaseException:
        async with EngineClient(url, timeout_s=0.3, retries=0) as c:
            t0 = time.monotonic()
            with pytest.raises(asyncio.TimeoutError) as e:
                await c.request("POST", "/slow", {})
            assert time.monotonic() - t0 < SLOW_S  # it gave up after 0.3 s, not waiting for the answer
            return e.value

    error = asyncio.run(go())
    assert isinstance(error, EngineTimeout) and "no answer within 0.3 s" in str(error)


@pytest.fixture(scope="module")
def faulty():
    app, state = faulty_app()
    with InProcessServer(app) as srv:
        yield srv.url, state


WHY = {"not_json": "not JSON", "missing_ids": "no integer 'output_ids'", "length_mismatch": "3 output ids but 2",
       "nan_logprob": "not [finite logprob", "out_of_vocab": "outside the vocabulary", "wrong_count": "2 item(s)"}


@pytest.mark.parametrize("mode", GARBAGE)
def test_malformed_generate_answer_is_a_bad_response(faulty, mode: str) -> None:
    url, state = faulty

    async def go() -> None:
        async with EngineClient(url, timeout_s=5, retries=3, backoff_s=0.01, vocab_size=VOCAB) as c:
            state["mode"] = "ok"
            ok = await c.generate(input_ids=[1], sampling_params={"max_new_tokens": 2}, return_logprob=True)
            assert ok["output_ids"] == [1, 1]
            state["mode"], calls = mode, state["calls"]
            try:
                await c.generate(input_ids=[1], sampling_params={"max_new_tokens": 2}, return_logprob=True)
            finally:
                assert state["calls"] == calls + 1  # a 200 with garbage is not retried on the same engine
                assert c.outstanding == 0

    with pytest.raises(EngineBadResponse, match="malformed response") as e:
        asyncio.run(go())
    assert WHY[mode] in str(e.value)
