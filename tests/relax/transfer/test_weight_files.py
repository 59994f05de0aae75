"""Weight files: safetensors bytes from the tensors' memory, the digest a manifest names, and stores
written with sha256 before xxh3_128 (a resumed run) loading and verifying as they did."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load as st_load

from relax import objstore
from relax.transfer import weight_files
from relax.transfer.errors import StoreError
from relax.transfer.weight_updates import WeightFollower
from relax.transfer.weights import WeightStore
from tests.relax.transfer.test_weight_versions_delta import Engine, bits, versions


def mixed() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    embed = torch.randn(7, 5, generator=g).bfloat16()
    return {"embed": embed, "head": embed, "f32": torch.randn(3, 3, generator=g), "i64": torch.tensor([5, -1]),
            "flag": torch.tensor([True, False, True]), "byte": torch.arange(3, dtype=torch.uint8),
            "half": torch.randn(4, generator=g).half(), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4)}


def test_serialized_parts_are_a_safetensors_file_any_reader_loads(tmp_path):
    state = mixed()
    parts = weight_files.serialize(state, {"format": "pt"})
    blob = b"".join(parts)
    loaded = st_load(blob)
    assert sorted(loaded) == sorted(state)
    for k, t in state.items():
        assert loaded[k].dtype == t.dtype and loaded[k].shape == t.shape and torch.equal(loaded[k], t), k
    path = tmp_path / "x.safetensors"
    path.write_bytes(blob)
    with safe_open(str(path), "pt") as f:  # the reader engines use on a folder
        assert f.metadata() == {"format": "pt"} and torch.equal(f.get_tensor("f32"), state["f32"])
    header = json.loads(blob[8:8 + int.from_bytes(blob[:8], "little")])
    start = 8 + int.from_bytes(blob[:8], "little")
    assert start % 8 == 0
    for k, t in state.items():  # every tensor starts at a multiple of its element size
        assert (start + header[k]["data_offsets"][0]) % t.element_size() == 0, k


def test_serialized_parts_alias_the_tensors_and_a_dtype_it_cannot_name_still_round_trips():
    w = torch.zeros(4, dtype=torch.bfloat16)
    parts = weight_files.serialize({"w": w})
    w.fill_(1.0)  # the parts are views: written after this, they hold the new bits
    assert torch.equal(st_load(b"".join(parts))["w"], w)
    c = {"c": torch.randn(3, dtype=torch.complex64)}  # not in the writer's table: safetensors' own save
    assert torch.equal(st_load(b"".join(weight_files.serialize(c)))["c"], c["c"])


def test_digest_is_the_same_however_the_bytes_are_cut():
    blob = bytes(range(256)) * 1000
    for algorithm in ("xxh3_128", "sha256"):
        whole = weight_files.digest([blob], algorithm)
        assert weight_files.digest([blob[:7], memoryview(blob)[7:]], algorithm) == whole
        assert weight_files.digest([blob[:-1] + b"\0"], algorithm) != whole
        assert len(whole) == 32 if algorithm == "xxh3_128" else len(whole) == 64  # 128 and 256 bits
    assert weight_files.digest([blob], "sha256") == hashlib.sha256(blob).hexdigest()


def test_a_new_manifest_names_its_digest_algorithm(tmp_path):
    store = WeightStore(str(tmp_path), "run", full_every=4)
    store.publish(0, versions(1)[0])
    m = store.manifest(0)
    assert m["digest"] == "xxh3_128" and all(isinstance(f["xxh3_128"], str) and "sha256" not in f for f in m["files"])
    blob = objstore.read_bytes(objstore.join(store.version_url(0), m["files"][0]["name"]))
    assert weight_files.digest([blob]) == m["files"][0]["xxh3_128"] and m["files"][0]["bytes"] == len(blob)


@pytest.mark.parametrize("named", ["md5", 7])
def test_an_unknown_digest_algorithm_is_a_store_error_naming_it(tmp_path, named):
    store = WeightStore(str(tmp_path), "run")
    store.publish(0, versions(1)[0])
    url = objstore.join(store.version_url(0), "manifest.json")
    manifest = json.loads(objstore.read_bytes(url))
    manifest["digest"] = named
    objstore.write_bytes(url, json.dumps(manifest).encode())
    with pytest.raises(StoreError, match=f"digest algorithm {named!r}"):
        store.load(0)


def _old_content(state: dict[str, torch.Tensor]) -> str:
    """The content hash as the code before xxh3_128 computed it: sha256 of each tensor, then of them all."""
    per = {}
    for n, t in state.items():
        h = hashlib.sha256(f"{n}\0{str(t.dtype).removeprefix('torch.')}\0{list(t.shape)}\0".encode())
        h.update(t.contiguous().view(-1).view(torch.uint8).numpy())
        per[n] = h.hexdigest()
    return hashlib.sha256("".join(f"{n}\0{per[n]}\n" for n in sorted(per)).encode()).hexdigest()


def _as_written_before(store: WeightStore, states: list[dict[str, torch.Tensor]]) -> None:
    """Rewrite every manifest of ``store`` as the code before xxh3_128 wrote it: no ``digest``, each
    file's sha256 under ``sha256``, sha256 content hashes (the files are safetensors either way)."""
    for v in store.versions():
        url = objstore.join(store.version_url(v), "manifest.json")
        m = json.loads(objstore.read_bytes(url))
        del m["digest"]
        for f in m["files"]:
            del f["xxh3_128"]
            blob = objstore.read_bytes(objstore.join(store.version_url(v), f["name"]))
            f["sha256"] = hashlib.sha256(blob).hexdigest()
        m["content"] = _old_content(states[v])
        if "delta" in m:
            m["delta"]["base_content"] = _old_content(states[m["delta"]["base"]])
        objstore.write_bytes(url, json.dumps(m).encode())


def test_a_store_written_with_sha256_loads_verifies_and_is_followed(tmp_path):
    vs = versions(4)
    store = WeightStore(str(tmp_path), "run", full_every=4)
    for v, state in enumerate(vs):
        store.publish(v, state)
    store.close()
    _as_written_before(store, vs)
    old = WeightStore(str(tmp_path), "run", full_every=4)
    assert "delta" in old.manifest(3) and "digest" not in old.manifest(3)
    assert bits(old.load(3)[0]) == bits(vs[3])  # rebuilt from version 0 and three deltas, sha256 content checked
    engine, follower = Engine(vs[0]), WeightFollower()
    assert engine.follow(follower, old, 1) == "full" and follower.content == _old_content(vs[1])
    assert engine.follow(follower, old, 3) == "delta" and bits(engine.tensors) == bits(vs[3])
    # the run resumes: the new publisher starts with a full version, hashed with xxh3_128; the engine follows
    nxt = {k: v.clone() for k, v in vs[3].items()}
    nxt["step"] = torch.tensor([4])
    old.publish(4, nxt)
    assert old.manifest(4)["digest"] == "xxh3_128" and "delta" not in old.manifest(4)
    assert engine.follow(follower, old, 4) == "full" and bits(engine.tensors) == bits(nxt)
    assert follower.refused == 0


def test_a_corrupted_file_of_a_sha256_store_is_refused(tmp_path):
    vs = versions(2)
    store = WeightStore(str(tmp_path), "run", full_every=4)
    for v, state in enumerate(vs):
        store.publish(v, state)
    _as_written_before(store, vs)
    name = store.manifest(1)["files"][0]["name"]
    path = objstore.join(store.version_url(1), name)
    blob = bytearray(objstore.read_bytes(path))
    blob[-1] ^= 1
    objstore.write_bytes(path, bytes(blob))
    with pytest.raises(StoreError, match=f"{name} fails its sha256 check"):
        store.load(1)
