"""Engines as Ray actors on the session's Ray cluster (4 CPUs): each holds its CPUs while it
lives, a launch the cluster cannot hold is refused whole, the elastic API answers 400 with the
reason, and an engine dies with its actor."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from relax.engines.client import EngineClient
from relax.rollout.remote_engines import RemoteEngines
from relax.services.api.elastic import ElasticRollout
from relax.services.launchers.process import CapacityError
from relax.services.run_record import ensure_run
from tests.polling import poll_until, wait_until
from tests.relax.engines.contract import save_tiny_model

pytestmark = pytest.mark.ray


def free_cpus(ray) -> float:
    return float(ray.available_resources().get("CPU", 0.0))


def settled_free_cpus(ray, quiet_s: float = 2.0, timeout_s: float = 30.0) -> float:
    """Free CPUs once the figure stops moving (releases of earlier tests' actors are async)."""
    deadline = time.monotonic() + timeout_s
    last, since = free_cpus(ray), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() < deadline:
        time.sleep(0.2)
        now = free_cpus(ray)
        if now != last:
            last, since = now, time.monotonic()
    return last


def settle(ray, expected: float, timeout_s: float = 30.0) -> float:
    # Ray frees an actor's resources asynchronously after it is killed
    poll_until(lambda: abs(free_cpus(ray) - expected) < 1e-6, timeout_s, interval=0.2)  # fractional CPUs: floats
    return free_cpus(ray)


def stops_answering(url: str, timeout_s: float = 20.0) -> bool:
    import urllib.request

    def refused() -> bool:
        try:
            urllib.request.urlopen(url + "/health", timeout=1).close()
            return False
        except OSError:
            return True

    return poll_until(refused, timeout_s, interval=0.2)


def generates(url: str) -> bool:
    async def go() -> dict:
        async with EngineClient(url) as c:
            # ignore_eos: a sampled EOS would end the answer early (a flaky False, seen once in CI)
            return await c.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 2, "ignore_eos": True})
    return len(asyncio.run(go())["output_ids"]) == 2


def test_ray_engines_hold_cluster_resources_and_refuse_what_does_not_fit(ray_session, tmp_path):
    from relax.services.launchers.ray_actors import RayEngineLauncher

    ray = ray_session
    folder = save_tiny_model(Path(tmp_path) / "m")
    launcher = RayEngineLauncher(folder, max_engines=8, num_cpus=1.0, max_batch_size=4)
    before = settled_free_cpus(ray)
    assert before >= 2
    engines = launcher.launch(2)
    try:
        assert all(e.alive and generates(e.url) for e in engines)
        assert settle(ray, before - 2) == pytest.approx(before - 2)  # each actor holds its CPU

        with pytest.raises(CapacityError, match=r"need \d+ CPU \(1 each\) and the Ray cluster has \d+ free"):
            launcher.launch(int(before))  # more than what is left: nothing is created
        assert free_cpus(ray) == before - 2 and len(launcher.running()) == 2

        # the engine process dies with its actor
        ray.kill(engines[0].actor)
        wait_until(lambda: not engines[0].alive, 30, interval=0.2,  # the kill lands asynchronously
                   what="the killed actor's engine to be gone")
        assert stops_answering(engines[0].url)
        assert len(launcher.running()) == 1

        # through the elastic API: a 400 naming the resources, the pool unchanged
        pool = RemoteEngines([engines[1].url])
        try:
            elastic = ElasticRollout(pool, launcher=launcher)
            op, _ = elastic.begin("scale_out", {"num_replicas": 5})  # within max_engines, past the CPUs
            elastic.execute(op)
            assert op.status == "failed" and op.http_status == 400 and "CPU" in op.error
            assert len(pool.engines()) == 1 and settle(ray, before - 1) == pytest.approx(before - 1)
        finally:
            pool.close()  # stops the launcher's engines too

    finally:
        launcher.stop_all()
    assert settle(ray, before) == pytest.approx(before)


def test_a_rollout_owns_its_engines_as_ray_actors(ray_session, tmp_path):
    from relax.services.roles.actor import ActorRole
    from relax.services.roles.rollout import RolloutRole
    from relax.services.run_context import RunContext
    from tests.relax.services.runtime_helpers import tiny_config

    ray = ray_session
    before = settled_free_cpus(ray)
    ctx = RunContext(tiny_config(f"file://{tmp_path}/root", "rayeng", "rollout.engine_processes=1",
                                 "rollout.engine_launcher=ray", "rollout.engine_cpus=1"))
    ensure_run(ctx)
    ActorRole(ctx).close()  # publishes weight version 0
    rollout = RolloutRole(ctx)
    try:
        assert settle(ray, before - 1) == pytest.approx(before - 1)  # its engine holds a CPU of the cluster
        rollout.step(timeout=60)
        table = rollout.pool.engines()
        assert len(table) == 1 and table[0]["healthy"]
        assert rollout.pool.weight_version == 0
    finally:
        rollout.close()
    assert settle(ray, before) == pytest.approx(before)  # the actor is gone with the rollout
