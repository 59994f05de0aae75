"""Consumer groups: complete groups, token budgets, staleness, exactly-once resume, corruption."""

from __future__ import annotations

import numpy as np
import pytest
from transfer_helpers import ADV, ROLLOUT_FIELDS, rollout_group

from relax import objstore
from relax.transfer.consumer import ConsumerGroup, load_group_state, replay, wait_for_capacity
from relax.transfer.errors import QueueTimeout
from relax.transfer.queue import TransferQueue


def fill(url, groups, size=2, version=0, length=3):
    q = TransferQueue(url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    for g in groups:
        p.put(rollout_group(g, size=size, policy_version=version, length=length))
    p.close()
    return q


def test_takes_only_complete_groups_in_arrival_order(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("a", size=3)[:2])  # group a is missing one member
    p.put(rollout_group("b") + rollout_group("c"))
    group = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=2)
    batch = group.take(0, current_version=0, timeout=5)
    assert batch.ids == ["b/0", "b/1", "c/0", "c/1"] and batch.groups == ["b", "b", "c", "c"]
    p.put(rollout_group("a", size=3)[2:])
    p.put(rollout_group("d"))
    assert group.take(1, current_version=0, timeout=5).ids == ["a/0", "a/1", "a/2", "d/0", "d/1"]


def test_consumer_waits_for_the_fields_it_needs(any_url):
    q = fill(any_url, ["g0", "g1"])
    group = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens", "advantages"],
                          batch_groups=1)
    with pytest.raises(QueueTimeout, match="not enough complete groups"):
        group.take(0, current_version=0, timeout=0.3)
    adv = q.producer("advantage", [ADV])
    adv.add_fields({"g1/0": {"advantages": np.ones(3, np.float32)}})
    with pytest.raises(QueueTimeout):  # half of g1 is not enough
        group.take(0, current_version=0, timeout=0.3)
    adv.add_fields({"g1/1": {"advantages": np.zeros(3, np.float32)}})
    batch = group.take(0, current_version=0, timeout=5)
    assert batch.ids == ["g1/0", "g1/1"] and [a.tolist() for a in batch.fields["advantages"]] == [[1, 1, 1], [0, 0, 0]]


def test_token_budget_batches(tmp_path):
    # groups of 2 samples x 4 tokens = 8 tokens each; a budget of 20 fits two groups (16), not three (24)
    fill(str(tmp_path), ["g0", "g1", "g2", "g3", "g4"], length=4)
    group = ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "actor", ["tokens"], token_budget=20,
                          flush_after_s=0.2)
    assert group.take(0, 0, timeout=5).groups == ["g0", "g0", "g1", "g1"]
    assert group.take(1, 0, timeout=5).groups == ["g2", "g2", "g3", "g3"]
    assert group.take(2, 0, timeout=5).groups == ["g4", "g4"]  # handed out partly filled after flush_after_s


def test_stale_samples_are_dropped_with_the_reason(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("old", policy_version=0))
    p.put(rollout_group("new", policy_version=2))
    group = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=1,
                          max_staleness=1)
    batch = group.take(0, current_version=3, timeout=5)  # 3 - 0 = 3 > 1: old is dropped; 3 - 2 = 1 is fine
    assert batch.ids == ["new/0", "new/1"]
    st = load_group_state(TransferQueue(any_url, "run", "rollouts"), "actor")
    assert st.dropped == {"old/0": "stale: policy_version 0, current 3, max_staleness 1",
                          "old/1": "stale: policy_version 0, current 3, max_staleness 1"}


def test_restart_resumes_after_the_last_recorded_step(any_url):
    fill(any_url, [f"g{i}" for i in range(6)])
    first = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=2)
    b0 = first.take(0, 0, timeout=5)
    b1 = first.take(1, 0, timeout=5)
    first.close()  # (a crash leaves the lease to a dead pid; the crash test covers that)
    again = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=2)
    assert again.next_step == 2
    # a trainer restored from a checkpoint at step 0 asks for step 1 again: same samples, marked replayed
    replayed = again.take(1, 0, timeout=5)
    assert replayed.ids == b1.ids and replayed.replayed
    b2 = again.take(2, 0, timeout=5)
    assert b2.ids == ["g4/0", "g4/1", "g5/0", "g5/1"] and not b2.replayed
    with pytest.raises(ValueError, match="next new step is 3"):
        again.take(5, 0)
    assert [r["ids"] for r in replay(TransferQueue(any_url, "run", "rollouts"), "actor")] == [b0.ids, b1.ids, b2.ids]


def test_groups_consume_independently(tmp_path):
    fill(str(tmp_path), ["g0"])
    a = ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "actor", ["tokens"], batch_groups=1)
    c = ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "critic", ["tokens"], batch_groups=1)
    assert a.take(0, 0, timeout=5).ids == c.take(0, 0, timeout=5).ids == ["g0/0", "g0/1"]


def test_corrupt_shard_is_reported_dropped_and_skipped(tmp_path):
    q = TransferQueue(str(tmp_path), "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("bad"))
    p.put(rollout_group("good"))
    q.refresh()
    bad_shard = q.state.samples["bad/0"].locs["tokens"][0]
    path = objstore.join(q.url, "shards", bad_shard)
    blob = bytearray(objstore.read_bytes(path))
    blob[-1] ^= 0xFF  # one flipped bit in the data
    objstore.write_bytes(path, bytes(blob))
    group = ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "actor", ["tokens"], batch_groups=1)
    assert group.take(0, 0, timeout=5).ids == ["good/0", "good/1"]
    reason = group.state.dropped["bad/0"]
    assert reason.startswith(f"corrupt: shard {bad_shard} is corrupt") and "crc32c" in reason


def test_producer_admission_is_bounded(tmp_path):
    # batch 4 samples, max_staleness 1: at most (1 + 1) * 4 = 8 generated-but-unconsumed samples
    q = fill(str(tmp_path), ["g0", "g1", "g2"])  # 6 unconsumed
    assert wait_for_capacity(q, "actor", batch_size=4, max_staleness=1, incoming=2, timeout=1) == 0
    with pytest.raises(QueueTimeout, match="6 unconsumed"):
        wait_for_capacity(q, "actor", batch_size=4, max_staleness=1, incoming=2, in_flight=1, timeout=0.3)
    ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "actor", ["tokens"], batch_groups=2).take(0, 0, 5)
    assert wait_for_capacity(q, "actor", batch_size=4, max_staleness=1, incoming=2, in_flight=1, timeout=1) == 3
    with pytest.raises(ValueError, match="can never be admitted"):
        wait_for_capacity(q, "actor", batch_size=4, max_staleness=0, incoming=5)


def test_padded_view():
    from relax.transfer.consumer import Batch

    b = Batch(0, ["a", "b"], ["g", "g"], [0, 0], {"t": [np.array([1, 2, 3]), np.array([4])]})
    values, mask = b.padded("t", pad=-1)
    assert values.tolist() == [[1, 2, 3], [4, -1, -1]] and mask.tolist() == [[True] * 3, [True, False, False]]
