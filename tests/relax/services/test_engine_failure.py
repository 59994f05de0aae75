"""A rollout served by two engine processes keeps going when one is SIGKILLed mid-run."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from relax.services.context import RunContext
from relax.services.controller import train
from relax.services.engine_launcher import NativeEngineProcess
from relax.services.metrics import read_metrics
from tests.relax.services.manifest_checks import check_run
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


def test_killing_an_engine_mid_run_does_not_stop_it(tmp_path):
    cfg = tiny_config(f"file://{tmp_path}/root", "engines", "trainer.total_steps=6")
    ctx = RunContext(cfg)
    model, _ = ctx.build_model()
    model.save_pretrained(tmp_path / "model")
    ctx.tokenizer.save_pretrained(tmp_path / "model")
    engines = [NativeEngineProcess(tmp_path / "model", max_batch_size=16, log_dir=tmp_path) for _ in range(2)]
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
        assert [m["weight_version"] for m in result.rollout] == list(range(6))
    finally:
        for e in engines:
            e.stop()
