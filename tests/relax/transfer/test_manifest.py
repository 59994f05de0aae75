"""Snapshot encoding of a topic's state: what is written reads back as the same state, and a
snapshot in the spelled-out format of earlier versions still loads."""

from __future__ import annotations

import json

from relax.transfer.manifest import TopicState

FIELDS = ["tokens", "logprobs", "reward", "response"]


def _state(steps: int) -> TopicState:
    """A rollout writer puts 4 samples a step; an advantage writer adds a field to each."""
    st = TopicState()
    for s in range(steps):
        ids = [[f"p{s}@{i}", f"g{s}", 4, s, 10 + i] for i in range(4)]
        st.apply("rollout.a", s, {"kind": "put", "shard": f"rollout.a/{s:08d}.safetensors", "crc32c": s,
                                  "nbytes": 100, "time": 1.0 + s, "samples": ids, "fields": FIELDS})
        st.apply(
            "advantage.b",
            s,
            {
                "kind": "fields",
                "shard": f"advantage.b/{s:08d}.safetensors",
                "crc32c": s,
                "nbytes": 10,
                "time": 1.5 + s,
                "ids": [i[0] for i in ids],
                "fields": ["advantages"],
            },
        )
    # a field for an id not put yet waits in `pending`; a second put of an id is a duplicate
    st.apply(
        "advantage.b",
        steps,
        {
            "kind": "fields",
            "shard": f"advantage.b/{steps:08d}.safetensors",
            "crc32c": 1,
            "nbytes": 1,
            "time": 99.0,
            "ids": ["later"],
            "fields": ["advantages"],
        },
    )
    st.apply(
        "rollout.a",
        steps,
        {
            "kind": "put",
            "shard": f"rollout.a/{steps:08d}.safetensors",
            "crc32c": 2,
            "nbytes": 1,
            "time": 100.0,
            "samples": [["p0@0", "g0", 4, 9, 3]],
            "fields": FIELDS,
        },
    )
    return st


def test_a_snapshot_reads_back_as_the_same_state():
    st = _state(5)
    back = TopicState.from_json(json.loads(json.dumps(st.to_json())))
    assert back.samples == st.samples  # every field's (shard, row) and every added field's commit order
    assert list(back.samples) == list(st.samples)
    assert back.heads == st.heads and back.shards == st.shards
    assert back.pending == st.pending and back.duplicates == st.duplicates
    assert back.samples["p3@2"].locs["advantages"] == ("advantage.b/00000003.safetensors", 2)
    assert back.samples["p3@2"].added["advantages"] == (4.5, "advantage.b", 3, 2)
    assert json.dumps(back.to_json()) == json.dumps(st.to_json())  # one state, one encoding


def test_each_shard_and_writer_is_named_once_however_many_fields_point_at_it():
    st = _state(50)
    text = json.dumps(st.to_json())
    assert text.count('"rollout.a/00000007.safetensors"') == 2  # the tables and the shard list, not per field
    spelled_out = json.dumps({"heads": st.heads, "samples": [m.to_json() for m in st.samples.values()]})
    assert len(text) < len(spelled_out) / 2  # 2.6x here with 5 fields; 6.7x on a real rollout topic (10)


def test_a_snapshot_in_the_spelled_out_format_still_loads():
    st = _state(3)
    old = {**st.to_json(), "samples": [m.to_json() for m in st.samples.values()]}
    del old["tables"]
    back = TopicState.from_json(json.loads(json.dumps(old)))
    assert back.samples == st.samples and back.heads == st.heads
