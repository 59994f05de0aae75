"""sglang-router (0.3.2, the real Rust router) in front of two native engines: generation, chat and streaming pass
through it, it reads the engines' model and load, workers come and go through its routes, and its API key is
passed on to the engines, whose guard needs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from tests.polling import wait_until
from tests.relax.engines.contract import free_port, save_tiny_model, start_subprocess

pytest.importorskip("sglang_router", reason="sglang-router is a dev dependency: pip install sglang-router==0.3.2")
pytestmark = pytest.mark.slow
TOKEN = os.environ["RELAX_ENGINE_TOKEN"]
GREEDY = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


def call(base: str, method: str, path: str, body: dict | None = None, token: str | None = TOKEN) -> tuple[int, str]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(base + path, data=None if body is None else json.dumps(body).encode(),
                                 headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:  # not listening yet
        return 0, ""


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("sgl-router")
    model = save_tiny_model(tmp / "model")
    engines = []
    for _ in range(2):
        port = free_port()
        engines.append(start_subprocess(["-m", "relax.engines.server", "--model-path", str(model), "--port", str(port)],
                                        port, tmp / f"engine-{port}.log"))
    port = free_port()
    router = subprocess.Popen([sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port",
                               str(port), "--worker-urls", engines[0][1], "--api-key", TOKEN, "--log-level", "warn"],
                              stdout=open(tmp / "router.log", "wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until(lambda: call(base, "GET", "/health")[0] == 200, interval=0.2, what="the router's /health")
        yield base, [url for _, url in engines], str(model)
    finally:
        router.terminate()
        router.wait(timeout=30)
        for proc, _ in engines:
            proc.terminate()
            proc.wait(timeout=30)


def workers(base: str) -> list[dict]:
    return json.loads(call(base, "GET", "/workers")[1])["workers"]


def test_generation_chat_and_streaming_pass_through(cluster):
    base, (e1, _), model = cluster
    body = {"input_ids": [5, 6, 7], "sampling_params": GREEDY}
    status, via = call(base, "POST", "/generate", body)
    assert status == 200 and json.loads(via)["output_ids"] == json.loads(call(e1, "POST", "/generate", body)[1])[
        "output_ids"]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 4,
            "temperature": 0.0}
    status, reply = call(base, "POST", "/v1/chat/completions", chat)
    assert status == 200 and json.loads(reply)["object"] == "chat.completion"
    status, stream = call(base, "POST", "/v1/chat/completions", {**chat, "stream": True})
    assert status == 200 and "chat.completion.chunk" in stream and stream.rstrip().endswith("data: [DONE]")
    assert call(base, "POST", "/generate", body, token=None)[0] == 401  # the router's own key
    assert json.loads(call(base, "GET", "/v1/models")[1])["data"][0]["id"] == model  # not 'unknown'


def test_workers_come_and_go_with_their_load_reported(cluster):
    base, (e1, e2), _ = cluster
    status, added = call(base, "POST", "/workers", {"url": e2, "api_key": TOKEN})
    assert status == 202, added
    wait_until(lambda: {w["url"] for w in workers(base)} == {e1, e2} and all(w["is_healthy"] for w in workers(base)),
               interval=0.2, what=lambda: f"both engines healthy in the router: {workers(base)}")
    loads = json.loads(call(base, "GET", "/get_loads")[1])["workers"]
    assert sorted(x["worker"] for x in loads) == sorted([e1, e2]) and all(x["load"] >= 0 for x in loads)  # was -1
    wid = next(w["id"] for w in workers(base) if w["url"] == e2)
    assert call(base, "DELETE", f"/workers/{wid}")[0] == 202
    wait_until(lambda: [w["url"] for w in workers(base)] == [e1], interval=0.2,
               what=lambda: f"the router without {e2}: {workers(base)}")
