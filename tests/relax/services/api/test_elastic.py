"""The elastic rollout REST API against real native engine servers and a real uvicorn server.

Three engine processes at most: E1 (the pool's first engine), E2 (an external engine added and
removed by URL) and one replica the API launches itself through the CLI test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import pytest

from relax.cli import scale_cmd
from relax.rollout.remote_engines import RemoteEngines
from relax.services.api.elastic import ElasticRollout, create_rollout_app
from relax.services.launchers.process import LocalProcessLauncher, NativeEngineProcess
from relax.transfer.weights import WeightStore
from tests.polling import wait_until
from tests.relax.engines.contract import InProcessServer, free_port, save_tiny_model

pytestmark = [pytest.mark.slow]

TOKEN = "s3cret-test-token"
GREEDY = {"temperature": 0.0, "max_new_tokens": 8, "ignore_eos": True}
LONG = {"temperature": 0.0, "max_new_tokens": 7000, "ignore_eos": True}  # a few seconds on the tiny model


def _http(method: str, url: str, body: Any = None, token: str | None = TOKEN) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token is not None:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory):
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("rollout-api")
    model_dir = save_tiny_model(tmp / "model", max_positions=8192)
    served = {"weight_store_root": str(tmp / "store"), "run_id": "run1"}  # what they may load weights from
    e1 = NativeEngineProcess(model_dir, max_batch_size=4, log_dir=tmp, **served)  # both boot in parallel
    e2 = NativeEngineProcess(model_dir, max_batch_size=4, log_dir=tmp, **served)
    pool = elastic = None
    try:
        e1.wait_healthy(120)
        e2.wait_healthy(120)
        store = WeightStore(str(tmp / "store"), "run1", fsync=False)
        state = load_file(str(model_dir / "model.safetensors"))
        store.publish(1, {k: (-v if k == "lm_head.weight" else v) for k, v in state.items()})  # flips argmaxes
        pool = RemoteEngines([e1.url])
        pool.load_weights(store, 1)
        launcher = LocalProcessLauncher(model_dir, max_engines=1, max_batch_size=4, log_dir=tmp, **served)
        elastic = ElasticRollout(pool, store, launcher, drain_timeout_s=120)
        with InProcessServer(create_rollout_app(elastic, TOKEN)) as api:
            yield SimpleNamespace(api=api.url, e1=e1, e2=e2, pool=pool, store=store, launcher=launcher,
                                  elastic=elastic, model_dir=model_dir)
    finally:
        if elastic is not None:
            elastic.close()
        if pool is not None:
            pool.close()
        e1.stop()
        e2.stop()


def _urls(env) -> list[str]:
    status, out = _http("GET", env.api + "/rollout/engines", token=None)
    assert status == 200, out
    return [e["url"] for e in out["engines"]]


def _set_e2(env, present: bool) -> None:
    """Bring E2 into or out of the pool directly, so each test starts from a known pool."""
    if present and env.e2.url not in _urls(env):
        env.pool.add_engine(env.e2.url, env.store)
    if not present and env.e2.url in _urls(env):
        env.pool.remove_engine(env.e2.url)


def _greedy(url: str) -> dict[str, Any]:
    status, out = _http("POST", url + "/generate", {"input_ids": [5, 6, 7], "sampling_params": GREEDY},
                        token=os.environ["RELAX_ENGINE_TOKEN"])  # engines answer the run's engine token
    assert status == 200, out
    return out


def test_token_required(env, monkeypatch: pytest.MonkeyPatch) -> None:
    bodies = {"/rollout/scale_out": {"engine_urls": [env.e2.url]}, "/rollout/scale_in": {"num_replicas": 1}}
    for path, body in bodies.items():
        for token in (None, "wrong-token"):
            status, out = _http("POST", env.api + path, body, token=token)
            assert status == 401 and "bearer token" in out["detail"], (path, token, out)
    assert env.e2.url not in _urls(env)  # GETs are open; nothing changed

    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    with pytest.raises(ValueError, match="RELAX_API_TOKEN"):
        create_rollout_app(env.elastic)
    monkeypatch.setenv("RELAX_API_TOKEN", "from-env")
    assert create_rollout_app(env.elastic).title == "Relax elastic rollout"

    status, spec = _http("GET", env.api + "/openapi.json", token=None)
    assert status == 200
    assert {"/rollout/scale_out", "/rollout/scale_in", "/rollout/engines", "/rollout/operations/{operation_id}",
            "/rollout/scale_out/{operation_id}"} <= set(spec["paths"])


def test_bad_requests_and_capacity_create_nothing(env) -> None:
    _set_e2(env, present=False)
    before = _urls(env)
    for path, body, needle in [
        ("/rollout/scale_out", {"num_replicas": 1, "engine_urls": [env.e2.url]}, "exactly one"),
        ("/rollout/scale_out", {}, "exactly one"),
        ("/rollout/scale_out", {"num_replicas": 0}, "num_replicas"),
        ("/rollout/scale_in", {"engine_urls": []}, "engine_urls"),
        ("/rollout/scale_out", {"num_replicas": 2}, "max_engines=1"),  # beyond the launcher's capacity
        ("/rollout/scale_in", {"engine_urls": ["http://127.0.0.1:1"]}, "not in the pool"),
        ("/rollout/scale_in", {"num_replicas": 1}, "leave the rollout"),  # the only engine
    ]:
        status, out = _http("POST", env.api + path, body)
        assert status == 400 and needle in out["detail"], (body, out)
    assert _urls(env) == before and env.launcher.running() == []


def test_failed_scale_out_is_rolled_back(env) -> None:
    _set_e2(env, present=False)
    dead = f"http://127.0.0.1:{free_port()}"
    status, out = _http("POST", env.api + "/rollout/scale_out",
                        {"engine_urls": [env.e2.url, dead], "operation_id": "half"})
    assert status == 502 and out["status"] == "failed" and dead in out["error"], out
    assert out["engines_added"] == [] and out["engines_removed"] == [env.e2.url]
    assert env.e2.url not in _urls(env)
    status, op = _http("GET", env.api + "/rollout/operations/half", token=None)
    assert status == 200 and op["status"] == "failed" and op["error"] == out["error"]


def test_scale_out_by_url_loads_current_weights_and_is_idempotent(env) -> None:
    _set_e2(env, present=False)
    body = {"engine_urls": [env.e2.url + "/"], "operation_id": "add-e2"}
    status, op = _http("POST", env.api + "/rollout/scale_out", body)
    assert status == 200 and op["status"] == "succeeded" and op["engines_added"] == [env.e2.url], op

    _, info = _http("GET", env.e2.url + "/get_model_info", token=os.environ["RELAX_ENGINE_TOKEN"])
    assert str(info["weight_version"]) == "1"
    first, second = _greedy(env.e1.url), _greedy(env.e2.url)
    assert first["output_ids"] == second["output_ids"] and second["meta_info"]["weight_version"] == "1"

    status, again = _http("POST", env.api + "/rollout/scale_out", body)  # a retry: the same operation
    assert status == 200 and again == op
    status, other = _http("POST", env.api + "/rollout/scale_out", {"engine_urls": [env.e2.url]})
    assert status == 200 and other["engines_added"] == [] and other["engines_skipped"] == [env.e2.url]
    status, out = _http("POST", env.api + "/rollout/scale_out", {**body, "engine_urls": ["http://x:1"]})
    assert status == 409 and "add-e2" in out["detail"]
    assert _urls(env) == [env.e1.url, env.e2.url]

    status, listed = _http("GET", env.api + "/rollout/engines", token=None)
    assert status == 200 and listed["weight_version"] == 1
    assert all(e["weight_version"] == 1 and e["healthy"] and not e["draining"] for e in listed["engines"])
    status, got = _http("GET", env.api + "/rollout/scale_out/add-e2", token=None)
    assert status == 200 and got == op


def test_scale_in_drains_and_a_second_operation_gets_409(env) -> None:
    _set_e2(env, present=True)
    done: list[float] = []

    async def one() -> dict[str, Any]:
        out = await env.pool.router.generate(input_ids=[5, 6, 7], sampling_params=LONG)
        done.append(time.monotonic())
        return out

    async def both() -> list[dict[str, Any]]:  # least-outstanding routing puts one on each engine
        return await asyncio.gather(one(), one())

    def engines() -> dict[str, dict[str, Any]]:
        return {e["url"]: e for e in _http("GET", env.api + "/rollout/engines", token=None)[1]["engines"]}

    with ThreadPoolExecutor(2) as ex:
        gens = ex.submit(env.pool.run, both())
        wait_until(lambda: all(e["outstanding"] == 1 for e in engines().values()), 30, interval=0.02,
                   what=lambda: f"a request on each engine: {engines()}")
        drain = ex.submit(_http, "POST", env.api + "/rollout/scale_in",
                          {"engine_urls": [env.e2.url], "operation_id": "drain-e2"})
        wait_until(lambda: engines()[env.e2.url]["draining"], 30, interval=0.02,
                   what=lambda: f"E2 draining: {engines()}")
        assert engines()[env.e2.url]["outstanding"] == 1  # still in the pool while its request runs

        status, out = _http("POST", env.api + "/rollout/scale_out", {"engine_urls": [env.e2.url]})
        assert status == 409 and "drain-e2" in out["detail"], out
        status, op = _http("GET", env.api + "/rollout/operations/drain-e2", token=None)
        assert op["status"] == "running"

        status, op = drain.result(timeout=120)
        removed_at = time.monotonic()
        assert status == 200 and op["status"] == "succeeded" and op["engines_removed"] == [env.e2.url], op
        results = gens.result(timeout=120)
    assert done and min(done) <= removed_at  # E2's request finished before E2 left the pool
    for r in results:
        assert len(r["output_ids"]) == LONG["max_new_tokens"] and r["meta_info"]["finish_reason"]["type"] == "length"
    assert _urls(env) == [env.e1.url]


def test_cli_launches_and_removes_a_native_replica(env, capsys: pytest.CaptureFixture[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    parser = argparse.ArgumentParser(prog="relax")
    scale_cmd.register(parser.add_subparsers(dest="area", required=True))

    def cli(*argv: str) -> tuple[int, str, str]:
        args = parser.parse_args(["scale", *argv])
        rc = args.func(args)
        out, err = capsys.readouterr()
        return rc, out, err

    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    rc, _, err = cli("out", env.api, "--replicas", "1")
    assert rc == 2 and "RELAX_API_TOKEN" in err
    rc, _, err = cli("out", env.api, "--replicas", "1", "--token", "wrong")
    assert rc == 2 and err.startswith("error: 401 ")
    rc, _, err = cli("out", env.api, "--replicas", "2", "--token", TOKEN)
    assert rc == 2 and err.startswith("error: 400 ") and "max_engines=1" in err

    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    _set_e2(env, present=False)
    rc, out, err = cli("out", env.api, "--replicas", "1", "--operation-id", "cli-out")
    assert rc == 0, err
    op = json.loads(out)
    assert op["status"] == "succeeded" and len(op["engines_added"]) == 1
    replica = op["engines_added"][0]
    assert [e.url for e in env.launcher.running()] == [replica]
    assert _greedy(replica)["output_ids"] == _greedy(env.e1.url)["output_ids"]  # loaded weight version 1

    rc, out, _ = cli("engines", env.api)
    listed = {e["url"]: e for e in json.loads(out)["engines"]}
    assert rc == 0 and set(listed) == {env.e1.url, replica} and listed[replica]["launched"]
    rc, out, _ = cli("operation", env.api, "cli-out")
    assert rc == 0 and json.loads(out)["engines_added"] == [replica]

    rc, out, err = cli("in", env.api, "--replicas", "1")  # launched engines go first
    assert rc == 0 and json.loads(out)["engines_removed"] == [replica], err
    assert _urls(env) == [env.e1.url] and env.launcher.running() == []
    rc, _, err = cli("in", env.api, "--engine-url", env.e1.url)
    assert rc == 2 and err.startswith("error: 400 ") and "leave the rollout" in err

