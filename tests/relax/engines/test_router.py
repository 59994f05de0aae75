"""Router: least-outstanding balancing, add/remove with draining, failover when an engine is
killed, answers garbage or times out.

Engines are real server subprocesses (``create_app`` over a stub engine that sleeps
``0.05 s * max_new_tokens`` and reports its name as ``weight_version``), so killing one is a
real SIGKILL mid-request. Run this file as ``python test_router.py --serve PORT NAME`` to
start one such server. The fault tests pair an in-process stub server with
``faulty_engine.faulty_app`` (a real HTTP server that misbehaves on demand).
"""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from relax.engines.client import EngineBadResponse
from relax.engines.router import NoEngineAvailable, Router
from relax.engines.types import Completion, GenerateRequest
from tests.polling import async_wait_until
from tests.relax.engines.contract import InProcessServer, free_port, start_subprocess
from tests.relax.engines.faulty_engine import GARBAGE, VOCAB, faulty_app


class StubTokenizer:
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(ch) % 50 for ch in text]

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


class StubEngine:
    """The NativeEngine interface without a model: fixed outputs, a delay per token."""

    def __init__(self, name: str):
        self.name, self.tokenizer, self.max_context_length, self.load = name, StubTokenizer(), 1024, 0

    async def generate(self, req: GenerateRequest) -> list[Completion]:
        self.load += 1
        try:
            await asyncio.sleep(0.05 * req.params.max_new_tokens)
        finally:
            self.load -= 1
        k = req.params.max_new_tokens
        return [Completion(req.rid, i, [1] * k, [-0.1] * k, {"type": "length", "length": k}, len(req.input_ids),
                           self.name) for i in range(req.params.n)]

    def abort(self, rid: str) -> bool:
        return False

    def flush_cache(self) -> bool:
        return True

    def update_weights(self, state_dict: dict, version: str) -> None:
        raise NotImplementedError

    def model_info(self) -> dict[str, Any]:
        return {"model_path": "stub", "max_context_length": 1024, "weight_version": self.name, "is_generation": True}


def serve(port: int, name: str) -> None:
    import uvicorn

    from relax.engines.server import create_app

    uvicorn.run(create_app(StubEngine(name), "stub"), host="127.0.0.1", port=port, log_level="warning")


@pytest.fixture
def engines(tmp_path: Path):
    started: dict[str, Any] = {}

    def start(name: str) -> str:
        port = free_port()
        proc, url = start_subprocess([__file__, "--serve", str(port), name], port, tmp_path / f"{name}.log")
        started[url] = proc
        return url

    yield start, started
    for proc in started.values():
        proc.kill()
        proc.wait(timeout=10)


def test_least_outstanding_and_round_robin(engines) -> None:
    start, _ = engines
    a, b = start("a"), start("b")

    async def go() -> None:
        router = Router([a, b], timeout_s=10)
        slow = [asyncio.create_task(router.generate(input_ids=[1], sampling_params={"max_new_tokens": 10}))
                for _ in range(4)]
        await async_wait_until(lambda: sum(e["outstanding"] for e in router.engines()) == 4, what=router.engines)
        assert sorted(e["outstanding"] for e in router.engines()) == [2, 2]
        # a is made busier: the next requests all go to b until the counts are even again
        busy = [asyncio.create_task(router.generate(input_ids=[1], sampling_params={"max_new_tokens": 10}))]
        await async_wait_until(lambda: sum(e["outstanding"] for e in router.engines()) == 5, what=router.engines)
        first = next(e for e in router.engines() if e["outstanding"] == 3)["url"]
        other = b if first == a else a
        quick = await router.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})
        assert quick["meta_info"]["weight_version"] == ("b" if other == b else "a")
        names = [r["meta_info"]["weight_version"] for r in await asyncio.gather(*slow, *busy)]
        assert sorted(names) in (["a", "a", "a", "b", "b"], ["a", "a", "b", "b", "b"])
        # idle ties alternate
        seq = [(await router.generate(input_ids=[1], sampling_params={"max_new_tokens": 1}))["meta_info"]
               ["weight_version"] for _ in range(4)]
        assert sorted(seq) == ["a", "a", "b", "b"] and seq[0] != seq[1]
        await router.close()

    asyncio.run(go())


def test_add_and_remove_with_drain(engines) -> None:
    start, _ = engines
    a = start("a")

    async def go() -> None:
        router = Router([a], timeout_s=10)
        with pytest.raises(ConnectionError):
            await router.add_engine(f"http://127.0.0.1:{free_port()}")
        b = start("b")
        await router.add_engine(b)
        assert [e["url"] for e in router.engines()] == [a, b]
        pending = [asyncio.create_task(router.generate(input_ids=[1], sampling_params={"max_new_tokens": 8}))
                   for _ in range(2)]
        await async_wait_until(lambda: [e["outstanding"] for e in router.engines()] == [1, 1], what=router.engines)
        assert not any(t.done() for t in pending)  # a's request is in flight as the removal starts
        await router.remove_engine(a, drain=True)  # waits for a's in-flight request
        done_at_removal = [t.done() for t in pending]
        assert [e["url"] for e in router.engines()] == [b]
        results = await asyncio.gather(*pending)
        assert all(len(r["output_ids"]) == 8 for r in results)
        assert [done for done, r in zip(done_at_removal, results, strict=True)
                if r["meta_info"]["weight_version"] == "a"] == [True]  # drained: a's request had finished
        r = await router.generate(input_ids=[1], sampling_params={"max_new_tokens": 1})
        assert r["meta_info"]["weight_version"] == "b"
        await router.remove_engine(b, drain=False)
        with pytest.raises(NoEngineAvailable):
            await router.generate(input_ids=[1])

    asyncio.run(go())


def test_failover_when_engine_is_killed(engines) -> None:
    start, started = engines
    a, b = start("a"), start("b")

    async def go() -> None:
        router = Router([a, b], timeout_s=10, retries=1, backoff_s=0.05)
        tasks = [asyncio.create_task(router.generate(input_ids=[1], sampling_params={"max_new_tokens": 10}))
                 for _ in range(4)]
        await async_wait_until(lambda: [e["outstanding"] for e in router.engines()] == [2, 2], what=router.engines)
        started[a].kill()  # SIGKILL with two requests in flight on a
        results = await asyncio.gather(*tasks)
        assert [r["meta_info"]["weight_version"] for r in results] == ["b"] * 4
        assert {e["url"]: e["healthy"] for e in router.engines()} == {a: False, b: True}
        await router.check_health()
        assert {e["url"]: e["healthy"] for e in router.engines()} == {a: False, b: True}
        await router.close()

    asyncio.run(go())


@pytest.fixture(scope="module")
def good_and_faulty():
    """``(good_url, faulty_url, faulty_state)``: a stub engine named "good" and a faulty one."""
    from relax.engines.server import create_app

    app, state = faulty_app()
    with InProcessServer(create_app(StubEngine("good"), "stub")) as good, InProcessServer(app) as bad:
        yield good.url, bad.url, state


TWO_TOKENS = {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}, "return_logprob": True}


async def _hit(router: Router, state: dict[str, Any]) -> None:
    """Send requests until one went to the faulty engine; each must still be answered by the good one."""
    calls = state["calls"]
    for _ in range(20):
        r = await router.generate(**TWO_TOKENS)
        assert r["meta_info"]["weight_version"] == "good"
        if state["calls"] > calls:
            return
    raise AssertionError("the faulty engine never got a request")


def _row(router: Router, url: str) -> dict[str, Any]:
    return next(e for e in router.engines() if e["url"] == url)


def test_garbage_answers_are_retried_on_another_engine(good_and_faulty) -> None:
    good, bad, state = good_and_faulty

    async def go() -> None:
        router = Router([bad, good], timeout_s=5, max_failures=len(GARBAGE) + 1, vocab_size=VOCAB)
        for i, mode in enumerate(GARBAGE, 1):
            state["mode"] = mode
            await _hit(router, state)
            row = _row(router, bad)
            assert row["healthy"] and row["consecutive_failures"] == row["failures"] == i, (mode, row)
            assert "malformed response" in row["last_error"]
        assert router.retries == len(GARBAGE) and router.unhealthy_marks == 0
        await router.close()
        # with nowhere else to go the request fails, naming the engine's fault
        state["mode"] = "length_mismatch"
        alone = Router([bad], timeout_s=5)
        with pytest.raises(NoEngineAvailable, match="output_token_logprobs") as e:
            await alone.generate(**TWO_TOKENS)
        assert isinstance(e.value.__cause__, EngineBadResponse)
        await alone.close()

    asyncio.run(go())


def test_consecutive_failures_mark_unhealthy_and_a_success_resets(good_and_faulty) -> None:
    good, bad, state = good_and_faulty

    async def go() -> None:
        router = Router([bad, good], timeout_s=5, max_failures=3)
        state["mode"] = "not_json"
        for _ in range(2):
            await _hit(router, state)
        assert _row(router, bad)["consecutive_failures"] == 2
        state["mode"] = "ok"
        calls = state["calls"]
        while state["calls"] == calls:
            await router.generate(**TWO_TOKENS)
        assert _row(router, bad)["consecutive_failures"] == 0 and _row(router, bad)["failures"] == 2
        state["mode"] = "not_json"
        for _ in range(3):
            await _hit(router, state)
        row = _row(router, bad)
        assert not row["healthy"] and row["consecutive_failures"] == 3 and router.unhealthy_marks == 1
        calls = state["calls"]
        for _ in range(4):  # out of rotation: nothing reaches it
            assert (await router.generate(**TWO_TOKENS))["meta_info"]["weight_version"] == "good"
        assert state["calls"] == calls
        await router.check_health()  # it answers /health: back in rotation with a clean count
        row = _row(router, bad)
        assert row["healthy"] and row["consecutive_failures"] == 0 and row["failures"] == 5
        await router.close()

    asyncio.run(go())


def test_a_timeout_counts_as_a_failure(good_and_faulty) -> None:
    good, bad, state = good_and_faulty

    async def go() -> None:
        state["mode"], state["slow_s"] = "slow", 4.0
        router = Router([bad, good], timeout_s=0.4, max_failures=2)
        for _ in range(2):
            t0 = time.monotonic()
            await _hit(router, state)
            # the timed-out request moved on after 0.4 s: waiting for the slow answer takes 4 s
            assert time.monotonic() - t0 < state["slow_s"]
        row = _row(router, bad)
        assert not row["healthy"] and row["failures"] == 2 and "no answer within 0.4 s" in row["last_error"]
        await router.close()

    asyncio.run(go())


if __name__ == "__main__" and sys.argv[1:2] == ["--serve"]:
    serve(int(sys.argv[2]), sys.argv[3])
