"""Async topology with ``rollout.api_port``: the Rollout deployment is Ray Serve's HTTP ingress
for the elastic REST API; ``relax scale`` reaches it through Serve's proxy while the run trains,
and a scale-out adds an engine process loaded with the run's current weights."""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request

import pytest

from relax.services.driver import train
from relax.services.run_context import RunContext
from tests.polling import poll_until
from tests.relax.engines.contract import auth
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = [pytest.mark.slow, pytest.mark.ray]
TOKEN = "s3rve"
PORT = 8000  # Serve's proxy port: the session's Serve keeps the port it first started on


def get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except OSError:
        return 0, {}


def post(url: str, body: dict, token: str | None) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {token}"} if token else {})}
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def test_the_rollout_deployment_serves_the_rest_api(tmp_path, ray_session, monkeypatch):
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    cfg = tiny_config(f"file://{tmp_path}", "ingress", "topology=async", "rollout.engine_processes=1",
                      "rollout.max_engine_processes=2", f"rollout.api_port={PORT}", "trainer.total_steps=150")
    outcome: dict = {}
    runner = threading.Thread(target=lambda: outcome.update(result=train(cfg, progress=False)), daemon=True)
    runner.start()
    api = f"http://127.0.0.1:{PORT}/{cfg.run_id}"
    answer = {"status": 0, "table": {}}

    def served_or_ended() -> bool:  # the assert below tells which, with the API's last answer
        if not runner.is_alive():
            return True
        answer["status"], answer["table"] = get(api + "/rollout/engines")
        return answer["status"] == 200 and answer["table"].get("weight_version", -1) >= 0

    poll_until(served_or_ended, 240, interval=0.5)
    status, table = answer["status"], answer["table"]
    assert status == 200 and len(table["engines"]) == 1, (status, table)

    assert post(api + "/rollout/scale_out", {"num_replicas": 1}, None)[0] == 401
    code, op = post(api + "/rollout/scale_out", {"num_replicas": 1}, TOKEN)
    assert code == 200 and op["status"] == "succeeded" and len(op["engines_added"]) == 1, op
    status, info = get(op["engines_added"][0] + "/get_model_info", auth())  # engines answer only the run's token
    assert status == 200 and int(info["weight_version"]) >= 0  # it loaded the run's weights first
    assert len(get(api + "/rollout/engines")[1]["engines"]) == 2

    runner.join(timeout=600)
    assert outcome["result"].steps == 150
    assert RunContext(cfg).weights().latest() == 150
