"""Adapter weight versions: adapter tensors only, their base named in the manifest, verified like any version."""

from __future__ import annotations

import json

import pytest
import torch

from relax import objstore
from relax.transfer.adapter_versions import AdapterVersion, load_version, merge, publish_adapter, resolve
from relax.transfer.errors import StoreError
from relax.transfer.weights import WeightStore

P = "base_model.model.layer.q_proj"


def parts(seed: int) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(seed)
    base = {"layer.q_proj.weight": torch.randn(6, 5, generator=g), "layer.norm.weight": torch.randn(5, generator=g)}
    adapter = {f"{P}.lora_A.weight": torch.randn(2, 5, generator=g),
               f"{P}.lora_B.weight": torch.randn(6, 2, generator=g)}
    return base, adapter


INFO = {"base_version": 0, "rank": 2, "alpha": 1.0, "scaling": 0.5, "target_modules": ["q_proj"]}


def test_an_adapter_version_holds_the_adapter_and_names_its_base(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    base, first = parts(0)
    _, second = parts(1)
    publish_adapter(store, 0, {**base, **first}, INFO)
    publish_adapter(store, 1, second, INFO, {"step": 0})
    manifest = store.manifest(1)
    assert manifest["meta"]["adapter"]["base_version"] == 0 and manifest["meta"]["step"] == 0
    assert sorted(t for f in manifest["files"] for t in f["tensors"]) == sorted(second)
    v1 = load_version(store, 1)
    assert isinstance(v1, AdapterVersion) and set(v1) == set(second) and v1.base_version == 0
    assert set(v1.load_base()) == set(base)
    whole = resolve(store, 1)
    want = base["layer.q_proj.weight"] + 0.5 * second[f"{P}.lora_B.weight"] @ second[f"{P}.lora_A.weight"]
    assert torch.equal(whole["layer.q_proj.weight"], want)
    assert torch.equal(whole["layer.norm.weight"], base["layer.norm.weight"])
    assert torch.equal(merge(base, first, 0.5)["layer.q_proj.weight"], resolve(store, 0)["layer.q_proj.weight"])


def test_a_tampered_adapter_or_a_missing_base_is_refused(tmp_path):
    store = WeightStore(str(tmp_path), "run")
    base, first = parts(0)
    publish_adapter(store, 0, {**base, **first}, INFO)
    publish_adapter(store, 1, parts(1)[1], INFO)
    name = store.manifest(1)["files"][0]["name"]
    blob = bytearray(objstore.read_bytes(objstore.join(store.version_url(1), name)))
    blob[-1] ^= 1
    objstore.write_bytes(objstore.join(store.version_url(1), name), bytes(blob))
    with pytest.raises(StoreError, match="fails its xxh3_128 check"):
        load_version(store, 1)
    publish_adapter(store, 2, parts(2)[1], {**INFO, "base_version": 7})
    with pytest.raises(StoreError, match="applies to base version 7, which is not published"):
        load_version(store, 2)
    with pytest.raises(ValueError, match="holds the adapter alone"):
        publish_adapter(store, 3, {**base, **first}, INFO)
    where = objstore.join(store.version_url(2), "manifest.json")
    manifest = json.loads(objstore.read_bytes(where))
    manifest["meta"]["adapter"]["scaling"] = "big"
    objstore.write_bytes(where, json.dumps(manifest).encode())
    with pytest.raises(StoreError, match="malformed adapter record"):
        load_version(store, 2)
