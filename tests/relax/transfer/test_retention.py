"""Retention deletes exactly the shards nobody can need."""

from __future__ import annotations

import pytest
from transfer_helpers import ROLLOUT_FIELDS, rollout_group

from relax import objstore
from relax.transfer.consumer import ConsumerGroup
from relax.transfer.errors import StoreError
from relax.transfer.queue import TransferQueue
from relax.transfer.retention import retain


def test_retention_follows_every_group_and_kept_checkpoints(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    for g in ("g0", "g1", "g2"):  # one shard per group
        p.put(rollout_group(g))
    shard = {g: q.state.samples[f"{g}/0"].locs["tokens"][0] for g in ("g0", "g1", "g2")}
    actor = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=1)
    critic = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "critic", ["tokens"], batch_groups=1)
    actor.take(0, 0, 5)
    actor.take(1, 0, 5)
    critic.take(0, 0, 5)
    # g0: consumed by both at step 0; g1: actor only; g2: nobody
    assert retain(q, keep_from_step={"actor": 0}) == []  # a checkpoint before step 0 must replay everything
    assert retain(q) == [shard["g0"]]
    assert not objstore.exists(objstore.join(q.url, "shards", shard["g0"]))
    assert objstore.exists(objstore.join(q.url, "shards", shard["g1"]))
    # replaying step 0 now fails naming the deleted shard
    actor.close()
    again = ConsumerGroup(TransferQueue(any_url, "run", "rollouts"), "actor", ["tokens"], batch_groups=1)
    with pytest.raises(StoreError, match=f"shard {shard['g0']} is missing"):
        again.take(0, 0, 5)


def test_orphan_shards_of_dead_writers_are_removed(tmp_path):
    q = TransferQueue(str(tmp_path), "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("g0"))
    orphan = f"{p.lease.key}/99999999.safetensors"
    objstore.write_bytes(objstore.join(q.url, "shards", orphan), b"never committed")
    ConsumerGroup(TransferQueue(str(tmp_path), "run", "rollouts"), "actor", ["tokens"], batch_groups=1)
    assert retain(q) == []  # the writer is alive: its uncommitted shard may be about to be committed
    p.close()
    assert retain(q) == [orphan]
