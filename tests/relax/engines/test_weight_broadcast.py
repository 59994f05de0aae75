"""SGLang's distributed weight update against the native engine server as real subprocesses, over gloo.

This test process is the trainer (rank 0, ``WeightBroadcaster``); two ``python -m relax.engines.server``
processes are the engines. A broadcast push must leave an engine computing exactly what the same weights
loaded from disk compute, under the pushed version; a bad tensor must be refused by name while the old
weights keep serving and the group stays usable."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from relax.engines.client import EngineClient
from relax.engines.weight_broadcast import WeightBroadcaster, WeightPushError, plan_buckets
from tests.relax.engines.contract import auth, free_port, save_tiny_model, start_subprocess

pytestmark = pytest.mark.slow  # two engine processes: about 20 s on two shared cores

GREEDY = {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True}
PROMPT = [5, 6, 7]


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory):
    tmp = Path(tmp_path_factory.mktemp("weight-broadcast"))
    model_dir = save_tiny_model(tmp / "model")
    root = str(tmp / "store")
    procs, urls = [], []
    try:
        for i in range(2):
            port = free_port()
            proc, url = start_subprocess(["-m", "relax.engines.server", "--model-path", str(model_dir), "--port",
                                          str(port), "--weight-store-root", root, "--run-id", "run1",
                                          "--max-batch-size", "4", "--num-threads", "1"], port, tmp / f"engine{i}.log")
            procs.append(proc)
            urls.append(url)
        yield urls, model_dir, root
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=30)


def perturbed(model_dir: Path, seed: int):
    """The served weights, changed enough to change greedy tokens (lm_head flipped, noise elsewhere)."""
    import torch
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    return {
        k: (-v if k == "lm_head.weight" else v + 0.05 * torch.randn(v.shape, generator=g)) for k, v in state.items()
    }


async def sample(c: EngineClient) -> tuple[list[int], list[float], str]:
    r = await c.generate(input_ids=PROMPT, sampling_params=GREEDY, return_logprob=True)
    lps = [t[0] for t in r["meta_info"]["output_token_logprobs"]]
    return r["output_ids"], lps, str(r["meta_info"]["weight_version"])


def test_buckets_cut_by_bytes_and_a_large_tensor_goes_alone() -> None:
    sizes = [("a", 40), ("b", 40), ("c", 300), ("d", 10), ("e", 10)]
    assert plan_buckets(sizes, 100) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_buckets(sizes, 1) == [[n] for n, _ in sizes]


def test_push_to_two_engines_equals_the_same_weights_from_disk(engines) -> None:
    """One group with both engines, buckets smaller than any tensor: both serve the pushed version and
    compute what the same tensors loaded through /update_weights_from_disk compute, to the last bit."""
    import torch.distributed as dist

    from relax.transfer.weights import WeightStore

    urls, model_dir, root = engines
    state = perturbed(model_dir, seed=1)
    WeightStore(root, "run1", fsync=False).publish(8, state)

    async def go() -> None:
        async with EngineClient(urls[0], timeout_s=120, retries=0) as a, \
                EngineClient(urls[1], timeout_s=120, retries=0) as b:
            base = await sample(a)
            pusher = WeightBroadcaster()
            await pusher.connect([a, b])
            assert pusher.ranks == [1, 2] and pusher.backend == "gloo"
            assert not dist.is_initialized()  # the group is its own, no default process group appeared
            stats = await pusher.push(state, 7, bucket_bytes=16)
            assert stats["buckets"] == len(state)  # each tensor alone: no bucket holds even one whole
            pushed_a, pushed_b = await sample(a), await sample(b)
            assert pushed_a[2] == pushed_b[2] == "7"
            assert (await a.model_info())["weight_version"] == "7"
            assert pushed_a[:2] == pushed_b[:2] and pushed_a[0] != base[0]
            r = await b.update_weights_from_disk("8")  # the same tensors, from the WeightStore
            assert r["success"] is True, r
            from_disk = await sample(b)
            assert from_disk[2] == "8" and from_disk[:2] == pushed_a[:2]
            await pusher.push(state, 9)  # default buckets: one request carries every tensor
            assert (await sample(b))[2] == "9"
            await pusher.close()

    asyncio.run(go())


def test_a_wrong_shape_or_unknown_tensor_is_refused_and_the_old_weights_serve(engines) -> None:
    import torch

    urls, model_dir, _ = engines
    good = perturbed(model_dir, seed=2)
    name = "model.layers.0.mlp.up_proj.weight"
    wrong = {**good, name: torch.zeros(3, 5)}
    unknown = {**good, "model.layers.9.extra.weight": torch.zeros(2, 2)}

    async def go() -> None:
        async with EngineClient(urls[0], timeout_s=120, retries=0) as a:
            pusher = WeightBroadcaster()
            await pusher.connect([a])
            await pusher.push(good, 20)
            before = await sample(a)
            with pytest.raises(WeightPushError) as e:
                await pusher.push(wrong, 21, bucket_bytes=1 << 10)
            shape = list(good[name].shape)
            assert f"'{name}' has shape [3, 5] but the model's '{name}' has shape {shape}" in str(e.value)
            assert urls[0] in str(e.value) and "still serving weight_version 20" in str(e.value)
            assert await sample(a) == before  # nothing of version 21 was applied, even the buckets before it
            with pytest.raises(WeightPushError, match="'model.layers.9.extra.weight' is not a tensor of this model"):
                await pusher.push(unknown, 22)
            assert await sample(a) == before
            await pusher.push(good, 23)  # the engine drained the refused buckets: the group is still in step
            assert (await sample(a))[2] == "23"
            await pusher.close()

    asyncio.run(go())


def test_the_server_answers_while_a_bucket_waits_for_its_broadcast(engines) -> None:
    """The receive runs off the event loop: /health and /generate answer while the engine waits in the collective."""
    import torch
    import torch.distributed as dist

    urls, model_dir, _ = engines
    state = perturbed(model_dir, seed=3)
    name = "lm_head.weight"

    async def go() -> None:
        async with EngineClient(urls[0], timeout_s=120, retries=0) as a:
            pusher = WeightBroadcaster()
            await pusher.connect([a])
            await pusher.push(state, 30)
            post = asyncio.ensure_future(a.update_weights_from_distributed(
                [name], ["float32"], [list(state[name].shape)], pusher.group_name, weight_version="31"))
            await asyncio.sleep(0.5)  # the engine is now blocked in the broadcast, waiting for rank 0
            assert await a.health(timeout_s=5) and (await sample(a))[2] == "30"
            assert not post.done()
            await asyncio.to_thread(dist.broadcast, state[name].to(torch.float32), group=pusher.group, group_src=0)
            r = await post
            assert r["success"] is True and "staged 1 of" in r["message"], r  # one tensor: not yet a whole model
            await pusher.close()

    asyncio.run(go())


def test_routes_need_the_token_and_an_unrunnable_backend_is_named(engines) -> None:
    urls, _, _ = engines
    body = {"master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2}
    for route in ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group"):
        req = urllib.request.Request(urls[0] + route, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 401, route

    def post(route: str, payload: dict) -> tuple[int, dict]:
        req = urllib.request.Request(urls[0] + route, data=json.dumps(payload).encode(),
                                     headers=auth({"Content-Type": "application/json"}))
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    for backend in ("nccl", "mpi"):  # no GPU here; mpi is no weight-update backend
        status, out = post("/init_weights_update_group", {**body, "backend": backend})
        assert status == 400 and out["success"] is False and f"'{backend}'" in out["message"], out
    status, out = post("/update_weights_from_distributed", {"names": ["x"], "dtypes": ["float32"], "shapes": [[1]],
                                                           "group_name": "never-made"})
    assert status == 400 and "call /init_weights_update_group first" in out["message"], out
