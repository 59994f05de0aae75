"""RemoteEngines.supervise against real native engine servers: an owned engine that hangs is
replaced by one serving the current weights; an external engine that restarted comes back
only after it was given the current weights."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import pytest

from relax.rollout.remote_engines import RemoteEngines
from relax.services.launchers.process import LocalProcessLauncher, NativeEngineProcess
from relax.transfer.weights import WeightStore
from tests.relax.engines.contract import auth, save_tiny_model

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0.0, "max_new_tokens": 4, "ignore_eos": True}


def _version(url: str) -> str:
    with urllib.request.urlopen(urllib.request.Request(url + "/get_model_info", headers=auth()), timeout=10) as r:
        return str(json.load(r)["weight_version"])


def _generate(pool: RemoteEngines, n: int) -> list[str]:
    """``n`` concurrent requests through the router; the weight version that answered each."""
    async def all_of() -> list[dict]:
        return await asyncio.gather(*(pool.router.generate(input_ids=[5, 6, 7], sampling_params=GREEDY,
                                                           return_logprob=True) for _ in range(n)))
    return [r["meta_info"]["weight_version"] for r in pool.run(all_of())]


def test_hung_owned_engine_is_replaced_and_restarted_external_engine_comes_back(tmp_path):
    from safetensors.torch import load_file

    model_dir = save_tiny_model(tmp_path / "model")
    store = WeightStore(str(tmp_path / "store"), "run1", fsync=False)
    state = load_file(str(model_dir / "model.safetensors"))
    store.publish(1, {k: (-v if k == "lm_head.weight" else v) for k, v in state.items()})
    served = {"weight_store_root": str(tmp_path / "store"), "run_id": "run1"}  # what they may load weights from
    launcher = LocalProcessLauncher(model_dir, max_engines=1, max_batch_size=4, log_dir=tmp_path, **served)
    # boots beside the owned one
    external = NativeEngineProcess(model_dir, max_batch_size=4, log_dir=tmp_path, **served)
    owned = launcher.launch(1)
    external.wait_healthy()
    restarted = None
    pool = RemoteEngines([external.url], owned=owned, launcher=launcher, store=store, timeout_s=2.0,
                         max_failures=1)
    try:
        pool.load_weights(store, 1)
        hung = owned[0]
        os.kill(hung.proc.pid, signal.SIGSTOP)  # alive, but answers nothing
        assert _generate(pool, 2) == ["1", "1"]  # the one sent to the hung engine timed out and moved
        rows = {e["url"]: e for e in pool.engines()}
        assert not rows[hung.url]["healthy"] and "no answer within 2 s" in rows[hung.url]["last_error"]

        report = pool.supervise()
        assert report["retired"] == [hung.url] and len(report["added"]) == 1 and not hung.alive
        new = report["added"][0]
        assert set(pool.owned) == {new} and _version(new) == "1" and pool.replaced == 1
        assert _generate(pool, 4) == ["1"] * 4 and all(e["healthy"] for e in pool.engines())

        # an external engine that dies is routed around, then restarts with its initial weights
        external.proc.kill()
        external.proc.wait()
        assert _generate(pool, 2) == ["1", "1"]
        assert not {e["url"]: e for e in pool.engines()}[external.url]["healthy"]
        assert pool.supervise() == {"retired": [], "added": [], "revived": []}  # still down: nothing to do
        restarted = NativeEngineProcess.start(
            model_dir, port=external.port, max_batch_size=4, log_dir=tmp_path, **served
        )
        assert _version(restarted.url) == "0"
        assert pool.supervise()["revived"] == [external.url]  # after it loaded version 1
        assert _version(restarted.url) == "1" and pool.replaced == 1
        assert all(e["healthy"] for e in pool.engines())
    finally:
        pool.close()  # stops the owned engines, not the external one
        assert not any(e.alive for e in launcher.running())
        for e in (external, restarted):
            if e is not None:
                e.stop()
