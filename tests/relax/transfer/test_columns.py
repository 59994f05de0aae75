"""Topic schemas and the shard codec."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from safetensors.numpy import load as st_load

from relax.transfer.columns import Field, TopicSchema, decode_shard, encode_shard, to_torch
from relax.transfer.errors import SchemaError

TOKENS = Field("tokens", "int64", (None,))
PATCHES = Field("patches", "float32", (None, 4))
REWARD = Field("reward", "float32")
IMAGE = Field("image", kind="bytes")
TEXT = Field("text", kind="str")
FIXED = Field("xyz", "float32", (3,))


def test_round_trip_of_every_kind():
    fields = {f.name: f for f in (TOKENS, PATCHES, REWARD, IMAGE, TEXT, FIXED)}
    rows = [
        {"tokens": [1, 2, 3], "patches": np.ones((2, 4), np.float32), "reward": 0.5, "image": b"\x89PNG",
         "text": "héllo", "xyz": [1.0, 2.0, 3.0]},
        {"tokens": np.array([7], dtype=np.int64), "patches": np.zeros((0, 4), np.float32), "reward": 1,
         "image": b"", "text": "", "xyz": np.zeros(3, np.float32)},
    ]
    columns = {n: [f.check(r[n], f"s{i}") for i, r in enumerate(rows)] for n, f in fields.items()}
    blob = b"".join(encode_shard(columns, fields, ["s0", "s1"]))
    ids, out = decode_shard(blob, "test")
    assert ids == ["s0", "s1"]
    assert out["tokens"][0].tolist() == [1, 2, 3] and out["tokens"][1].tolist() == [7]
    assert out["patches"][0].shape == (2, 4) and out["patches"][1].shape == (0, 4)
    assert float(out["reward"][0]) == 0.5 and out["reward"][0].dtype == np.float32
    assert out["image"] == [b"\x89PNG", b""] and out["text"] == ["héllo", ""]
    assert out["xyz"][0].tolist() == [1.0, 2.0, 3.0]
    # the shard is a standard safetensors file: the reference reader agrees on every tensor
    reference = st_load(blob)
    assert reference["tokens"].tolist() == [1, 2, 3, 7] and reference["tokens.offsets"].tolist() == [0, 3, 4]
    assert reference["patches"].shape == (2, 4) and bytes(reference["image"]) == b"\x89PNG"


@pytest.mark.parametrize(
    "field, value, fragment",
    [
        (TOKENS, np.array([1.5, 2.5]), "dtype float64 contradicts the topic schema (int64)"),
        (TOKENS, np.zeros((2, 2), np.int64), "shape (2, 2) contradicts the topic schema (*)"),
        (PATCHES, np.zeros((2, 3), np.float32), "shape (2, 3) contradicts the topic schema (*, 4)"),
        (REWARD, np.zeros(2, np.float32), "shape (2,) contradicts the topic schema ()"),
        (IMAGE, "not bytes", "expected bytes, got str"),
        (TEXT, b"bytes", "expected str, got bytes"),
        (REWARD, torch.zeros((), dtype=torch.bfloat16), "bfloat16 tensor for a float32 field"),
    ],
)
def test_mismatches_name_sample_and_field(field, value, fragment):
    with pytest.raises(SchemaError) as err:
        field.check(value, "s9")
    assert fragment in str(err.value)
    if "expected" in fragment or "contradicts" in fragment:
        assert f"sample 's9' field '{field.name}'" in str(err.value)


def test_bfloat16_survives_as_raw_bits():
    f = Field("hidden", "bfloat16", (None,))
    t = torch.tensor([1.5, -2.25, 3.0], dtype=torch.bfloat16)
    (_, out) = decode_shard(b"".join(encode_shard({"hidden": [f.check(t, "a")]}, {"hidden": f}, ["a"])), "t")
    assert torch.equal(to_torch(out["hidden"][0], f), t)


def test_python_numbers_take_the_schema_dtype():
    assert REWARD.check(1, "a").dtype == np.float32
    assert TOKENS.check([1, 2], "a").dtype == np.int64


def test_schema_declarations():
    with pytest.raises(SchemaError, match="declared twice"):
        TopicSchema((TOKENS, TOKENS))
    with pytest.raises(SchemaError, match="per-sample bookkeeping"):
        TopicSchema((Field("policy_version", "int64"),))
    with pytest.raises(SchemaError, match="only the first dimension"):
        Field("x", "float32", (2, None))
    with pytest.raises(SchemaError, match="kind must be one of"):
        Field("x", kind="json")
    merged = TopicSchema((TOKENS,)).merge(TopicSchema((TOKENS, REWARD)))
    assert [f.name for f in merged.fields] == ["tokens", "reward"]
    with pytest.raises(SchemaError, match="declared as"):
        TopicSchema((TOKENS,)).merge(TopicSchema((Field("tokens", "int32", (None,)),)))
    assert TopicSchema.from_json(merged.to_json()) == merged
