"""A rollout served by two engine processes keeps going when one is SIGKILLed mid-run; an
engine the rollout owns (``rollout.engine_processes``) is also replaced, with the current weights."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import urllib.request

import pytest

from relax.services.driver import train
from relax.services.launchers.process import NativeEngineProcess
from relax.services.policy import build_model
from relax.services.report.metrics import read_metrics
from relax.services.roles.actor import ActorRole
from relax.services.roles.advantage import AdvantageRole
from relax.services.roles.rollout import RolloutRole
from relax.services.run_context import RunContext
from relax.services.run_record import ensure_run
from relax.transfer.errors import QueueTimeout
from tests.relax.engines.contract import auth
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_killing_an_engine_mid_run_does_not_stop_it(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}/root", "engines", "trainer.total_steps=6")
    ctx = RunContext(cfg)
    model, _ = build_model(ctx)
    model.save_pretrained(tmp_path / "model")
    ctx.tokenizer.save_pretrained(tmp_path / "model")
    engines = [NativeEngineProcess(tmp_path / "model", max_batch_size=16, log_dir=tmp_path, weight_store_root=cfg.root,
                                   run_id=cfg.run_id) for _ in range(2)]
    try:
        for e in engines:
            e.wait_healthy()

        def kill_later():
            while len(read_metrics(ctx.run_url, "rollout")) < 2:
                time.sleep(0.05)
            os.kill(engines[0].proc.pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_later, daemon=True)
        killer.start()
        result = train(cfg, progress=False, engine_urls=[e.url for e in engines])
        killer.join(timeout=5)
        assert not engines[0].alive
        assert result.steps == 6
        check_run(ctx, 6)
        # every batch after the kill was still generated under the current weights, by the survivor
        assert [m["weight_version"] for m in result.metrics("rollout")] == list(range(6))
    finally:
        for e in engines:
            e.stop()


def _weight_version(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url + "/get_model_info", headers=auth()), timeout=10) as r:
        return str(json.load(r)["weight_version"])


def test_a_killed_owned_engine_is_replaced_with_the_current_weights(tmp_path):
    # total_steps is only an upper bound: the run stops 2 batches after the replacement serves,
    # which takes an engine boot (seconds to a minute on a busy machine), not a number of steps
    cap, deadline = 1000, time.monotonic() + 240
    cfg = tiny_config(f"file://{tmp_path}/root", "owned", f"trainer.total_steps={cap}",
                      "rollout.engine_processes=2", "rollout.supervise_interval_s=0.5")
    ctx = RunContext(cfg)
    ensure_run(ctx)
    # the colocated loop of relax.services.topologies.colocated.run_colocated, kept here to watch the pool
    actor, adv, rollout = ActorRole(ctx), AdvantageRole(ctx), RolloutRole(ctx)
    pool = rollout.pool
    victim_url, victim = next(iter(pool.owned.items()))
    killed = threading.Event()

    def kill_mid_batch():
        while rollout.batch < 1 or not any(e["url"] == victim_url and e["outstanding"] for e in pool.engines()):
            time.sleep(0.005)
        os.kill(victim.proc.pid, signal.SIGKILL)  # with requests in flight on it
        killed.set()

    threading.Thread(target=kill_mid_batch, daemon=True).start()
    metrics, after = [], 0
    try:
        # stop on a checkpoint step, so the lineage check below sees the run's last step
        while actor.step_index < cap and time.monotonic() < deadline and \
                (after < 2 or actor.step_index % cfg.trainer.checkpoint_every):
            for role in (actor, adv):
                try:
                    role.step(timeout=0)
                    break
                except QueueTimeout:
                    continue
            else:
                metrics.append(rollout.step(timeout=60))
                after += metrics[-1]["engines_replaced"] == 1 and metrics[-1]["engines_healthy"] == 2
        assert killed.is_set() and not victim.alive
        assert after >= 2, f"no replacement served within 240 s; engines: {pool.engines()}"
        assert pool.replaced == 1
        table = {e["url"]: e for e in pool.engines()}
        assert victim_url not in table and set(table) == set(pool.owned) and len(table) == 2
        assert all(e["healthy"] for e in table.values()), table
        current = str(pool.weight_version)
        assert {url: _weight_version(url) for url in table} == {url: current for url in table}
        processes = [victim, *pool.owned.values()]
    finally:
        for role in (rollout, adv, actor):
            role.close()
    assert not any(p.alive for p in processes)  # closing the rollout stopped its engines
    steps = actor.step_index
    check_run(ctx, steps)
    assert [m["weight_version"] for m in metrics] == list(range(len(metrics)))
