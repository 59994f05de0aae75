"""Names read back from storage cannot leave the run: a record, snapshot or weight manifest that names
another run's file, an absolute path or anything but the layout's own pattern is a named error, and
nothing is read, trained on or deleted."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from relax import objstore
from relax.transfer.errors import StoreError
from relax.transfer.manifest import TopicState, check_shard_name
from relax.transfer.weights import WeightStore

KEY = "rollout-0.1712345678901-ab12cd"


def record(shard: str, **changes) -> dict:
    body = {"kind": "put", "shard": shard, "crc32c": 1, "nbytes": 8, "fields": ["x"], "time": 1.0,
            "samples": [["s0", "g0", 1, 0, 3]]}
    body.update(changes)
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("shard", ["../other-run/queue/rollouts/shards/w.1/00000000.safetensors",
                                   "/etc/passwd", f"{KEY}/../../x.safetensors", "s3://bucket/x",
                                   "rollout-1.9-zz/00000000.safetensors"])  # the last: another writer's shard
def test_a_record_naming_anything_but_its_own_shard_is_refused(shard):
    st = TopicState()
    with pytest.raises(StoreError, match=f"record {KEY}/0 names shard"):
        st.apply(KEY, 0, record(shard))
    assert st.shards == {} and st.samples == {} and st.heads == {}  # nothing of it was folded in
    st.apply(KEY, 0, record(f"{KEY}/00000000.safetensors"))
    assert list(st.samples) == ["s0"]


def test_a_record_missing_a_key_names_it():
    # was: KeyError: 'crc32c'
    with pytest.raises(StoreError, match=rf"record {KEY}/0 is malformed: no \['crc32c'\]"):
        TopicState().apply(KEY, 0, record(f"{KEY}/00000000.safetensors", crc32c=None))


def test_shard_names_are_checked_where_they_are_used(tmp_path):
    from relax.transfer.columns import Field
    from relax.transfer.queue import TransferQueue

    for bad in ("..", "../x/00000001.safetensors", "a/b/00000001.safetensors", "a/1.safetensors"):
        with pytest.raises(StoreError, match="not a shard of this topic"):
            check_shard_name(bad, "test")
    q = TransferQueue(f"file://{tmp_path}", "r", "t")
    p = q.producer("w", [Field("x", "int64", (None,))], tokens_field=None)
    p.put([{"id": "s0", "x": [1, 2]}])
    (tmp_path / "outside.safetensors").write_bytes(b"secret")
    q.state.shards["../../../../outside.safetensors"] = q.state.shards[next(iter(q.state.shards))]
    with pytest.raises(StoreError, match="not a shard of this topic"):
        q.load_shard("../../../../outside.safetensors")
    with pytest.raises(StoreError, match="committed by no record"):
        q.load_shard("w.1-x/00000009.safetensors")
    p.close()


def _tamper(store: WeightStore, version: int, name: str) -> None:
    """Point version's manifest at ``name``, with a sha256 that matches whatever is there."""
    url = objstore.join(store.version_url(version), "manifest.json")
    manifest = json.loads(objstore.read_bytes(url))
    manifest["files"][0]["name"] = name
    manifest["files"][0]["sha256"] = hashlib.sha256(b"x").hexdigest()
    objstore.write_bytes(url, json.dumps(manifest).encode())


@pytest.mark.parametrize("name", ["../../other-run/weights/00000000/model-00001-of-00001.safetensors",
                                  "/etc/hostname", "model-00001-of-00001.safetensors/../../x"])
def test_a_weight_manifest_naming_a_foreign_file_loads_nothing(tmp_path, name):
    store = WeightStore(f"file://{tmp_path}", "run")
    store.publish(0, {"w": torch.ones(2)})
    _tamper(store, 0, name)
    with pytest.raises(StoreError, match="names weight file"):
        store.load(0)


def test_a_snapshot_row_naming_media_outside_the_snapshot_is_refused(tmp_path):
    from relax.data.errors import DataError
    from relax.data.snapshot import Snapshot
    from relax.data.sources import snapshot_from_config
    from tests.relax.data.test_snapshot import make_dataset

    info = snapshot_from_config(make_dataset(str(tmp_path / "src")), str(tmp_path / "root"))
    rows_url = objstore.join(info.url, "rows", "train.jsonl")
    original = objstore.read_bytes(rows_url).decode()
    image = json.loads(next(line for line in original.splitlines() if '"i1"' in line))["images"][0]
    for path, sha in (("../../../src/img/a.png", image["sha256"]), (image["path"], None)):
        rows = original.replace(json.dumps(image["path"]), json.dumps(path))
        if sha is None:  # a row without its media's sha256 would skip the check
            rows = rows.replace(f',"sha256":"{image["sha256"]}"', "")
        objstore.write_bytes(rows_url, rows.encode())
        manifest_url = objstore.join(info.url, "manifest.json")
        manifest = json.loads(objstore.read_bytes(manifest_url))
        manifest["splits"]["train"]["sha256"] = hashlib.sha256(rows.encode()).hexdigest()  # the hash matches
        objstore.write_bytes(manifest_url, json.dumps(manifest).encode())
        with pytest.raises(DataError, match="is not a file of this snapshot"):
            list(Snapshot(info.url).samples("train"))


@pytest.mark.parametrize("size", [0, -1, 1.5, True])
def test_put_refuses_a_group_size_no_group_can_reach(tmp_path, size):
    # group_size 0 or -1 used to commit, and then every consumer crashed with IndexError on every restart
    from relax.transfer.columns import Field
    from relax.transfer.errors import SchemaError
    from relax.transfer.queue import TransferQueue

    q = TransferQueue(f"file://{tmp_path}", "r", "t")
    p = q.producer("w", [Field("x", "int64", (None,))], tokens_field=None)
    with pytest.raises(SchemaError, match=f"group_size must be an integer >= 1, got {size!r}"):
        p.put([{"id": "s0", "group": "g", "group_size": size, "x": [1]}])
    q.refresh()
    assert q.state.samples == {}  # nothing committed
    p.close()
