"""Delta versions in the WeightStore and the engine side that follows them (WeightFollower)."""

from __future__ import annotations

import json

import pytest
import torch

from relax import objstore
from relax.transfer.errors import StoreError
from relax.transfer.weight_updates import WeightFollower, plan
from relax.transfer.weights import WeightStore


def bits(state: dict[str, torch.Tensor]) -> dict[str, bytes]:
    return {k: bytes(v.contiguous().view(-1).view(torch.uint8).numpy()) for k, v in state.items()}


def versions(n: int, fraction: float = 0.02) -> list[dict[str, torch.Tensor]]:
    """``n`` bf16 versions, each a few elements away from the one before, as small RL steps leave them."""
    g = torch.Generator().manual_seed(0)
    state = {"embed.weight": torch.randn(96, 64, generator=g).bfloat16(), "norm.weight": torch.ones(64).bfloat16(),
             "step": torch.tensor([0])}
    out = [{k: v.clone() for k, v in state.items()}]
    for v in range(1, n):
        flat = state["embed.weight"].view(-1)
        where = (torch.rand(flat.numel(), generator=g) < fraction).nonzero().squeeze(1)
        flat[where] += torch.randn(where.numel(), generator=g).bfloat16() * 0.01
        state["step"] = torch.tensor([v])
        out.append({k: t.clone() for k, t in state.items()})
    return out


class Engine:
    """An engine's tensors and its swap, as the native engine offers them."""

    def __init__(self, like: dict[str, torch.Tensor]):
        self.tensors = {k: torch.zeros_like(v) for k, v in like.items()}
        self.version = None
        self.swaps = 0

    def swap(self, write, label):
        write()
        self.version, self.swaps = label, self.swaps + 1

    def load_full(self, state, label):
        for k, v in state.items():
            self.tensors[k].copy_(v)
        self.version = label

    def follow(self, follower, store, version):
        return follower.update(store, version, lambda: self.tensors, self.swap,
                               lambda state: self.load_full(state, str(version)))


def test_a_chain_of_deltas_reproduces_every_version(any_url):
    vs = versions(7)
    store = WeightStore(any_url, "run", full_every=3)
    for v, state in enumerate(vs):
        store.publish(v, state, {"step": v})
    kinds = ["delta" in store.manifest(v) for v in range(7)]
    assert kinds == [False, True, True, False, True, True, False]  # a full version every 3
    full = sum(f["bytes"] for f in store.manifest(0)["files"])
    assert all(sum(f["bytes"] for f in store.manifest(v)["files"]) * 4 < full for v in (1, 2, 4, 5))
    for v, state in enumerate(vs):
        loaded, meta = WeightStore(any_url, "run").load(v)
        assert bits(loaded) == bits(state) and meta == {"step": v}
    m = store.manifest(2)
    assert m["delta"]["base"] == 1 and m["delta"]["base_content"] == store.manifest(1)["content"]


def test_an_engine_follows_by_deltas_and_lands_on_the_same_bits_after_skipping(tmp_path):
    vs = versions(8)
    store = WeightStore(str(tmp_path), "run", full_every=8)
    engine, follower = Engine(vs[0]), WeightFollower()
    store.publish(0, vs[0])
    assert engine.follow(follower, store, 0) == "full"
    for v in range(1, 8):
        store.publish(v, vs[v])
    assert engine.follow(follower, store, 1) == "delta"
    assert bits(engine.tensors) == bits(vs[1])
    assert engine.follow(follower, store, 5) == "delta"  # skipped 2..4: applies their deltas in turn
    assert bits(engine.tensors) == bits(vs[5]) and engine.version == "5"
    fresh = Engine(vs[0])  # an engine that never held a version loads the version whole
    assert fresh.follow(WeightFollower(), store, 7) == "full" and bits(fresh.tensors) == bits(vs[7])


def test_plan_takes_the_fewer_bytes():
    chain = [{"version": 0, "content": "a", "files": [{"bytes": 100}]},
             *({"version": v, "content": c, "files": [{"bytes": 30}]} for v, c in ((1, "b"), (2, "c"), (3, "d")))]
    assert plan(chain, 1, "b") == ("delta", 2)
    assert plan(chain, 1, "other") == ("full", 0)  # the engine's content is not the chain's
    assert plan(chain, None, None) == ("full", 0)
    dense = [chain[0], *({**m, "files": [{"bytes": 90}]} for m in chain[1:])]
    assert plan(dense, 0, "a") == ("delta", 1)  # 270 < 100 + 270
    assert plan(chain, 3, "d") == ("full", 0)  # holds the target: nothing to apply, reload it


def test_a_corrupted_delta_is_refused_and_the_engine_keeps_exact_bits(tmp_path):
    vs = versions(4)
    store = WeightStore(str(tmp_path), "run", full_every=4)
    for v, state in enumerate(vs):
        store.publish(v, state)
    engine, follower = Engine(vs[0]), WeightFollower()
    engine.follow(follower, store, 1)
    f = store.manifest(2)["files"][0]
    path = objstore.local_path(objstore.join(store.version_url(2), f["name"]))
    blob = bytearray(open(path, "rb").read())
    blob[-1] ^= 0xFF
    open(path, "wb").write(bytes(blob))
    with pytest.raises(StoreError, match="fails its xxh3_128"):
        engine.follow(follower, store, 2)  # the whole version needs the same delta: nothing to fall back to
    assert bits(engine.tensors) == bits(vs[1]) and follower.refused == 1 and engine.version == "1"


def test_a_delta_over_other_bits_is_undone_and_the_version_loaded_whole(tmp_path):
    vs = versions(4)
    store = WeightStore(str(tmp_path), "run", full_every=4)
    for v, state in enumerate(vs):
        store.publish(v, state)
    engine, follower = Engine(vs[0]), WeightFollower()
    engine.follow(follower, store, 1)
    engine.tensors["norm.weight"][3] = 7.0  # the engine's weights drifted from what the follower believes
    assert engine.follow(follower, store, 3) == "full"
    assert bits(engine.tensors) == bits(vs[3]) and follower.refused == 1
    assert engine.follow(follower, store, 3) == "full"  # its content is known again: the next delta applies
    store.publish(4, versions(5)[4])
    assert engine.follow(follower, store, 4) == "full"  # version 4 is full (full_every=4)


def test_a_delta_whose_manifest_lies_about_its_base_is_refused(tmp_path):
    vs = versions(3)
    store = WeightStore(str(tmp_path), "run", full_every=3)
    for v, state in enumerate(vs):
        store.publish(v, state)
    where = objstore.join(store.version_url(2), "manifest.json")
    m = json.loads(objstore.read_bytes(where))
    m["delta"]["base_content"] = "0" * 64
    objstore.write_bytes(where, json.dumps(m).encode())
    with pytest.raises(StoreError, match="content hash differs"):
        store.load(2)


def test_retention_keeps_what_kept_deltas_are_rebuilt_from(tmp_path):
    vs = versions(6)
    store = WeightStore(str(tmp_path), "run", full_every=6)
    for v, state in enumerate(vs):
        store.publish(v, state)
    assert store.retain([], keep_latest=1) == []  # 5 is a delta over 4, 3, 2, 1 and the full 0
    assert bits(store.load(5)[0]) == bits(vs[5])


def test_a_restarted_publisher_starts_with_a_full_version(tmp_path):
    vs = versions(3)
    store = WeightStore(str(tmp_path), "run", full_every=8)
    store.publish(0, vs[0])
    store.publish(1, vs[1])
    store.close()
    again = WeightStore(str(tmp_path), "run", full_every=8)
    again.publish(2, vs[2])
    assert "delta" in store.manifest(1) and "delta" not in store.manifest(2)


def test_a_delta_costing_more_than_the_full_version_is_published_full(tmp_path):
    vs = [{"w": torch.randn(64, 64, generator=torch.Generator().manual_seed(v))} for v in range(2)]  # all new
    store = WeightStore(str(tmp_path), "run", full_every=8)
    store.publish(0, vs[0])
    store.publish(1, vs[1])
    assert "delta" not in store.manifest(1) and bits(store.load(1)[0]) == bits(vs[1])


class CountingStore(WeightStore):
    """The real store, counting manifest reads (each is a GET on S3)."""

    reads = 0

    def manifest(self, version):
        self.reads += 1
        return super().manifest(version)


def test_a_sync_reads_each_manifest_of_its_chain_once(tmp_path):
    vs = versions(8)
    store = CountingStore(str(tmp_path), "run", full_every=8)
    for v, state in enumerate(vs):
        store.publish(v, state)
    store.reads = 0
    assert Engine(vs[0]).follow(WeightFollower(), store, 7) == "full"  # chain: version 0 whole + 7 deltas
    assert store.reads == 8  # the plan and the rebuild share one read of the chain, not 8 + 8
    assert bits(store.load(7, chain=store.chain(7))[0]) == bits(vs[7])
    assert bits(store.load(7, chain=store.chain(5))[0]) == bits(vs[7])  # another version's chain is not used
