"""A pool whose only engine dies waits for the supervisor's replacement instead of failing:
a weight load is retried on the replacement, a generate call is sent again (with the same
rids, so it answers the same). A pool without a launcher still fails at once."""

from __future__ import annotations

import json
import os
import signal
import urllib.request

import pytest

from relax.engines.router import NoEngineAvailable
from relax.engines.types import SamplingParams
from relax.rollout.prompts import EncodedPrompt
from relax.rollout.remote_engines import RemoteEngines
from relax.services.launchers.process import LocalProcessLauncher, NativeEngineProcess
from relax.transfer.weights import WeightStore
from tests.relax.engines.contract import auth, save_tiny_model

pytestmark = pytest.mark.slow

PROMPTS = [EncodedPrompt([5, 6, 7], None, [], []), EncodedPrompt([8, 9], None, [], [])]
GREEDY = [SamplingParams(max_new_tokens=4, temperature=0.0, ignore_eos=True) for _ in PROMPTS]
RIDS = ["outage-a", "outage-b"]


def _version(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url + "/get_model_info", headers=auth()), timeout=10) as r:
        return str(json.load(r)["weight_version"])


def _kill(engine: NativeEngineProcess) -> None:
    os.killpg(engine.proc.pid, signal.SIGKILL)
    engine.proc.wait()


@pytest.fixture
def store_and_model(tmp_path):
    from safetensors.torch import load_file

    model_dir = save_tiny_model(tmp_path / "model")
    store = WeightStore(str(tmp_path / "store"), "run1", fsync=False)
    state = load_file(str(model_dir / "model.safetensors"))
    store.publish(1, {k: (-v if k == "lm_head.weight" else v) for k, v in state.items()})
    store.publish(2, state)
    served = {"weight_store_root": str(tmp_path / "store"), "run_id": "run1", "max_batch_size": 4,
              "log_dir": tmp_path}
    return store, model_dir, served


def test_a_pool_whose_only_owned_engine_dies_waits_for_its_replacement(store_and_model, caplog):
    store, model_dir, served = store_and_model
    launcher = LocalProcessLauncher(model_dir, max_engines=1, **served)
    [first] = launcher.launch(1)
    pool = RemoteEngines([], owned=[first], launcher=launcher, store=store, timeout_s=120.0)
    try:
        _kill(first)
        pool.load_weights(store, 1)  # no engine could load it: retried on the replacement
        assert "no engine serving weight version 1; waiting up to 120 s for a replacement" in caplog.text
        [second] = pool.owned.values()
        assert second.url != first.url and _version(second.url) == "1" and pool.weight_version == 1
        faults = pool.fault_counts()
        assert faults["engines_replaced"] == 1 and faults["engine_outages"] == 1 and faults["engines_healthy"] == 1

        before = pool.generate(PROMPTS, GREEDY, RIDS)
        assert [c.weight_version for per_prompt in before for c in per_prompt] == ["1", "1"]
        _kill(second)
        after = pool.generate(PROMPTS, GREEDY, RIDS)  # waited for the next replacement, then sent again
        assert after == before
        [third] = pool.owned.values()
        assert third.url not in (first.url, second.url) and _version(third.url) == "1"
        faults = pool.fault_counts()
        assert faults["engines_replaced"] == 2 and faults["engine_outages"] == 2 and faults["engines_healthy"] == 1
    finally:
        pool.close()
    assert not any(e.alive for e in launcher.running())


def test_a_pool_without_a_launcher_fails_at_once_when_its_only_engine_dies(store_and_model):
    store, model_dir, served = store_and_model
    external = NativeEngineProcess.start(model_dir, **served)
    pool = RemoteEngines([external.url], store=store, timeout_s=120.0)
    try:
        pool.load_weights(store, 1)
        _kill(external)
        with pytest.raises(NoEngineAvailable):
            pool.generate(PROMPTS, GREEDY, RIDS)
        with pytest.raises(RuntimeError, match="no engine could load weight version 2"):
            pool.load_weights(store, 2)
        assert pool.weight_version == 1 and pool.fault_counts()["engine_outages"] == 0
    finally:
        pool.close()
        external.stop()
