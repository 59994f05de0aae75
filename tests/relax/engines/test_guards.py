"""The engine server's guard: mutating routes need the token (403 without one configured, 401 with a wrong
one) and change nothing when refused; a body over the limit is a 413 while /health keeps answering."""

from __future__ import annotations

import json
import urllib.request

import pytest
from fastapi import Body, FastAPI

from relax.engines.guards import Guard, check_bind
from tests.relax.engines.contract import InProcessServer


def app_with(token: str | None, limit: int = 1 << 20) -> tuple[Guard, list]:
    calls: list = []
    app = FastAPI()

    @app.post("/update_weights_from_disk")
    async def update(body: dict = Body(...)) -> dict:
        calls.append(body)
        return {"success": True}

    @app.post("/generate")
    async def generate(body: dict = Body(...)) -> dict:
        return {"text": "ok"}

    @app.get("/health")
    async def health() -> dict:
        return {}

    return Guard(app, token=token, max_body_bytes=limit), calls


def call(url: str, path: str, body: bytes | None = b"{}", token: str | None = None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url + path, data=body, headers=headers, method="POST" if body is not None else "GET")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_mutating_routes_need_the_token_and_change_nothing_when_refused():
    app, calls = app_with(token="s3cret")
    with InProcessServer(app) as srv:
        assert call(srv.url, "/update_weights_from_disk")[0] == 401
        status, reply = call(srv.url, "/update_weights_from_disk", token="wrong")
        assert status == 401 and "Authorization: Bearer" in reply["error"]["message"]
        assert calls == []  # nothing reached the route
        assert call(srv.url, "/generate")[0] == 401  # with a token set, generation needs it too (SGLang --api-key)
        assert call(srv.url, "/health", body=None)[0] == 200  # liveness probes never do
        assert call(srv.url, "/update_weights_from_disk", token="s3cret")[0] == 200 and len(calls) == 1
        assert call(srv.url, "/generate", token="s3cret")[0] == 200


def test_without_a_token_mutating_routes_are_closed_and_generation_open():
    app, calls = app_with(token=None)
    with InProcessServer(app) as srv:
        status, reply = call(srv.url, "/update_weights_from_disk", token="anything")
        assert status == 403 and "started without a token" in reply["error"]["message"] and calls == []
        assert call(srv.url, "/generate")[0] == 200


def announce(url: str, path: str, length: int, token: str) -> tuple[int, dict]:
    """Send only the headers of a ``length``-byte POST and read the answer: the server refuses by the
    declared length, without waiting for (or storing) the body."""
    import http.client
    from urllib.parse import urlparse

    u = urlparse(url)
    conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    conn.putrequest("POST", path)
    for k, v in (("Content-Type", "application/json"), ("Content-Length", str(length)),
                 ("Authorization", f"Bearer {token}")):
        conn.putheader(k, v)
    conn.endheaders()
    r = conn.getresponse()
    out = r.status, json.loads(r.read())
    conn.close()
    return out


def test_a_body_over_the_limit_is_413_and_health_keeps_answering():
    app, calls = app_with(token="t", limit=1 << 20)
    with InProcessServer(app) as srv:
        status, reply = announce(srv.url, "/update_weights_from_disk", 10 << 20, "t")  # a 10 MB body
        assert status == 413 and "--max-body-bytes" in reply["error"]["message"] and calls == []
        assert call(srv.url, "/health", body=None)[0] == 200
        # a body without a declared length (chunked) is cut off at the limit as it streams in
        import http.client
        from urllib.parse import urlparse

        u = urlparse(srv.url)
        conn = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
        chunks = (b"x" * 65536 for _ in range(40))  # 2.5 MB
        conn.request("POST", "/generate", body=chunks, headers={"Authorization": "Bearer t",
                                                               "Content-Type": "application/json"},
                     encode_chunked=True)
        assert conn.getresponse().status == 413
        conn.close()
        assert call(srv.url, "/update_weights_from_disk", body=b'{"model_path": "x"}', token="t")[0] == 200


@pytest.mark.parametrize(("host", "token", "ok"), [("127.0.0.1", None, True), ("localhost", None, True),
                                                   ("::1", None, True), ("0.0.0.0", None, False),
                                                   ("10.1.2.3", None, False), ("0.0.0.0", "t", True)])
def test_a_non_loopback_bind_needs_a_token(host, token, ok):
    if ok:
        check_bind(host, token)
    else:
        with pytest.raises(SystemExit, match="refusing to listen"):
            check_bind(host, token)
