"""WeightStore: publish, load, atomic visibility, retention."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from relax import objstore
from relax.transfer.errors import QueueTimeout, StoreError, TransferError
from relax.transfer.weights import WeightStore


def state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"embed.weight": torch.randn(16, 8, generator=g), "norm.weight": torch.randn(8, generator=g).bfloat16(),
            "step": torch.tensor([seed])}


def test_publish_and_load_every_dtype(any_url):
    store = WeightStore(any_url, "run", max_shard_bytes=256)  # 16*8*4 = 512 bytes: forces several files
    store.publish(0, state(0), {"step": 0})
    store.publish(1, state(1))
    loaded, meta = store.load(0)
    assert meta == {"step": 0}
    assert all(torch.equal(loaded[k], v) and loaded[k].dtype == v.dtype for k, v in state(0).items())
    assert len(store.manifest(0)["files"]) >= 2
    assert store.latest() == 1 and torch.equal(store.load()[0]["step"], torch.tensor([1]))


def test_versions_are_immutable(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    store.publish(3, state(0))
    with pytest.raises(TransferError, match="version 3 is already published"):
        store.publish(3, state(1))


def test_half_published_version_is_invisible(tmp_path, monkeypatch):
    store = WeightStore(str(tmp_path), "run", max_shard_bytes=256)
    real = objstore.write_bytes
    calls = []

    def die_after_first_file(url, blob, fsync=True):
        calls.append(url)
        if len(calls) == 2:  # the lease, then one weight file, then the publisher "dies"
            raise OSError("killed")
        real(url, blob, fsync)

    monkeypatch.setattr(objstore, "write_bytes", die_after_first_file)
    with pytest.raises(OSError):
        store.publish(0, state(0))
    monkeypatch.setattr(objstore, "write_bytes", real)
    assert WeightStore(str(tmp_path), "run").versions() == []
    with pytest.raises(StoreError, match="no weight version is published"):
        WeightStore(str(tmp_path), "run").load()


def test_corrupt_file_is_named(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    store.publish(0, state(0))
    name = store.manifest(0)["files"][0]["name"]
    objstore.write_bytes(objstore.join(store.version_url(0), name), b"garbage")
    with pytest.raises(StoreError, match=f"{name} fails its xxh3_128 check"):
        store.load(0)


def test_a_torn_manifest_is_a_store_error_naming_the_file(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    store.publish(0, state(0))
    where = objstore.join(store.version_url(0), "manifest.json")
    objstore.write_bytes(where, objstore.read_bytes(where)[:20])  # a power loss mid-write
    with pytest.raises(StoreError, match=f"weight manifest {where} is not valid JSON"):
        store.load(0)


def test_wait_for_a_version(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    with pytest.raises(QueueTimeout, match="weight version 0 not published within 0.2 s"):
        store.wait_for(0, timeout=0.2)
    threading.Timer(0.2, lambda: store.publish(0, state(0))).start()
    t0 = time.monotonic()
    assert WeightStore(str(tmp_path), "run").wait_for(0, timeout=10) == 0
    assert time.monotonic() - t0 < 10


def test_retention_keeps_referenced_and_latest(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    for v in range(5):
        store.publish(v, state(v))
    assert store.retain(keep=[1], keep_latest=2) == [0, 2]  # keep 1 (a checkpoint) and 3, 4 (newest)
    assert store.versions() == [1, 3, 4]
    assert not (tmp_path / "runs/run/weights/00000000").exists()
