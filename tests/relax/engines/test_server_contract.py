"""The native engine server as a real subprocess (``python -m relax.engines.server``) against the contract."""

from __future__ import annotations

import asyncio
import json
import urllib.request
from pathlib import Path

import pytest

from relax.engines.client import EngineClient
from tests.relax.engines.contract import auth, free_port, run_contract, save_tiny_model, start_subprocess


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    tmp = tmp_path_factory.mktemp("native-server")
    model_dir = save_tiny_model(tmp / "model")
    root = str(tmp / "store")
    port = free_port()
    proc, url = start_subprocess(["-m", "relax.engines.server", "--model-path", str(model_dir), "--port", str(port),
                                  "--weight-store-root", root, "--run-id", "run1", "--max-batch-size", "8"],
                                 port, tmp / "server.log")
    yield url, model_dir, root
    proc.terminate()
    proc.wait(timeout=30)


def test_contract(server) -> None:
    url, _, _ = server
    facts = run_contract(url)
    assert facts["info"]["max_context_length"] == 64 and facts["info"]["is_generation"] is True


def test_health_generate_flush_and_openapi(server) -> None:
    url, _, _ = server
    with urllib.request.urlopen(url + "/health_generate", timeout=30) as r:
        assert r.status == 200
    req = urllib.request.Request(url + "/flush_cache", method="POST", headers=auth())
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    with urllib.request.urlopen(urllib.request.Request(url + "/openapi.json", headers=auth()), timeout=30) as r:
        paths = json.load(r)["paths"]
    assert {"/generate", "/v1/chat/completions", "/update_weights_from_disk", "/abort_request"} <= set(paths)


def test_update_weights_from_store_and_folder(server) -> None:
    """Publish the served weights (v1) and perturbed ones (v2) to a WeightStore; swap by URL, then back by folder."""
    from safetensors.torch import load_file

    from relax.transfer.weights import WeightStore

    url, model_dir, root = server
    state = load_file(str(Path(model_dir) / "model.safetensors"))
    store = WeightStore(root, "run1", fsync=False)
    v1 = store.publish(1, state)
    perturbed = {k: (-v if k == "lm_head.weight" else v) for k, v in state.items()}  # flips every argmax
    store.publish(2, perturbed)
    greedy = {"temperature": 0.0, "max_new_tokens": 5, "ignore_eos": True}

    async def go() -> None:
        async with EngineClient(url, timeout_s=60, retries=0) as c:
            base = (await c.generate(input_ids=[5, 6, 7], sampling_params=greedy))["output_ids"]
            r = await c.update_weights_from_disk(v1)
            assert r["success"] is True, r
            out = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            assert out["output_ids"] == base and out["meta_info"]["weight_version"] == "1"
            r = await c.update_weights_from_disk("2")  # a bare version of the configured store/run
            assert r["success"] is True, r
            out = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            assert out["output_ids"][0] != base[0] and out["meta_info"]["weight_version"] == "2"
            r = await c.update_weights_from_disk(str(model_dir), version="orig")  # a label the caller made up
            assert r["success"] is False and "is not the version" in r["message"], r
            r = await c.update_weights_from_disk(str(model_dir))  # the served folder: its name is the version
            assert r["success"] is True, r
            out = await c.generate(input_ids=[5, 6, 7], sampling_params=greedy)
            assert out["output_ids"] == base and out["meta_info"]["weight_version"] == "model"
            assert (await c.model_info())["weight_version"] == "model"

    asyncio.run(go())


def test_weight_update_outside_the_allow_list_is_403_and_changes_nothing(server, tmp_path) -> None:
    # another folder with safetensors, another run's store, ../ out of the store, a remote URL: each would make
    # the server read what a caller names; the served weights stay
    import shutil

    url, model_dir, root = server
    other = tmp_path / "elsewhere"
    shutil.copytree(model_dir, other)
    scratch = Path(root.removeprefix("file://")) / "scratch"  # a folder of weights inside the store's root
    shutil.copytree(model_dir, scratch)
    own = f"{root}/runs/run1/weights/00000001"  # the run's own version named as a folder: no manifest, no sha256
    for path in (str(other), f"{root}/runs/other-run/weights/1", f"{root}/runs/run1/weights/../../../../etc",
                 "http://127.0.0.1:9/weights", f"{model_dir}/../{other.name}", str(scratch),
                 own.replace("/runs/run1/", "/runs/run1/./"), own.removeprefix("file://") + "/."):
        req = urllib.request.Request(url + "/update_weights_from_disk", data=json.dumps({"model_path": path}).encode(),
                                     headers=auth({"Content-Type": "application/json"}))
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 403, path
        assert "outside what this engine loads from" in json.loads(err.value.read())["message"]
    with urllib.request.urlopen(urllib.request.Request(url + "/get_model_info", headers=auth()), timeout=30) as r:
        assert json.load(r)["weight_version"] != "elsewhere"


def test_a_weight_store_without_a_run_is_refused_at_start(tmp_path) -> None:
    # with a store root but no run id, any run's versions under that root would load
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "relax.engines.server", "--model-path", str(tmp_path),
                        "--weight-store-root", str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--weight-store-root and --run-id go together" in r.stderr
