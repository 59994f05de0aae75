"""The elastic REST API served by a running rollout (``rollout.api_port``): ``relax scale`` adds an
engine process that loads the run's current weights before traffic, the rollout generates on
both, a scale-out past ``rollout.max_engine_processes`` is refused whole, and a scale-in drains."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from relax.cli.main import main as relax_cli
from relax.config import ConfigError
from relax.engines.client import EngineClient
from relax.services.roles.actor import ActorRole
from relax.services.roles.rollout import RolloutRole
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from tests.relax.services.runtime_helpers import tiny_config

TOKEN = "t0ken"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli(capsys, *args: str) -> tuple[int, object]:
    code = relax_cli(list(args))
    out, err = capsys.readouterr()
    return code, (json.loads(out) if code == 0 else err)


def engine_version(url: str) -> str:
    async def ask() -> str:
        async with EngineClient(url) as c:
            return str((await c.model_info())["weight_version"])
    return asyncio.run(ask())


def test_relax_scale_against_a_running_rollout(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    port = free_port()
    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "api", "rollout.engine_processes=1",
                                 "rollout.max_engine_processes=2", f"rollout.api_port={port}"))
    ensure_run(ctx)
    ActorRole(ctx).close()  # publishes weight version 0
    rollout = RolloutRole(ctx)
    api = f"http://127.0.0.1:{port}"
    try:
        rollout.step(timeout=60)  # the engine loads version 0
        code, table = cli(capsys, "scale", "engines", api)
        assert code == 0 and table["weight_version"] == 0 and len(table["engines"]) == 1
        first = table["engines"][0]["url"]

        code, err = cli(capsys, "scale", "out", api, "--replicas", "1", "--token", "wrong")
        assert code == 2 and "401" in err

        code, op = cli(capsys, "scale", "out", api, "--replicas", "1")  # token from RELAX_API_TOKEN
        assert code == 0 and op["status"] == "succeeded" and len(op["engines_added"]) == 1, op
        added = op["engines_added"][0]
        assert engine_version(added) == "0"  # loaded the run's weights before it was routed to

        code, err = cli(capsys, "scale", "out", api, "--replicas", "1")  # a third would pass the cap of 2
        assert code == 2 and ("409" in err or "400" in err)
        assert len(cli(capsys, "scale", "engines", api)[1]["engines"]) == 2  # nothing half-created

        batch = rollout.step(timeout=60)  # generation spreads over both engines
        assert batch is not None
        served = {e["url"]: e for e in cli(capsys, "scale", "engines", api)[1]["engines"]}
        assert set(served) == {first, added}

        code, op = cli(capsys, "scale", "in", api, "--engine-url", added)
        assert code == 0 and op["engines_removed"] == [added]
        assert [e["url"] for e in cli(capsys, "scale", "engines", api)[1]["engines"]] == [first]
    finally:
        rollout.close()
    with pytest.raises(OSError):  # the API stopped with the rollout
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_an_api_the_rollout_cannot_serve_fails_before_any_engine_starts(tmp_path, monkeypatch):
    monkeypatch.delenv("RELAX_API_TOKEN", raising=False)
    port = free_port()
    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "noapi", "rollout.engine_processes=1",
                                 f"rollout.api_port={port}"))
    ensure_run(ctx)
    with pytest.raises(ConfigError, match="RELAX_API_TOKEN"):
        RolloutRole(ctx)
    monkeypatch.setenv("RELAX_API_TOKEN", TOKEN)
    local = RunContext(tiny_config(f"file://{tmp_path}/root", "inproc", f"rollout.api_port={port}"))
    ensure_run(local)
    with pytest.raises(ConfigError, match="engine_processes"):
        RolloutRole(local)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        with pytest.raises(ConfigError, match=f"rollout.api_port {port} on 127.0.0.1 is in use"):
            RolloutRole(ctx)


def test_an_engine_cap_below_the_engines_started_is_refused():
    from relax.config import load_config

    with pytest.raises(ConfigError, match=r"max_engine_processes \(1\) is below rollout.engine_processes \(2\)"):
        load_config("tiny-cpu", ["rollout.engine_processes=2", "rollout.max_engine_processes=1"])
