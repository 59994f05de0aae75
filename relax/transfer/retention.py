"""Retention: delete shards no one can need any more.

A shard may go when every consumer group has consumed (or dropped) every sample it holds
*before* the oldest step a kept checkpoint may have to replay. Commit records stay (they
are small and keep the manifest a pure function of the logs); a replay that reaches a
deleted shard fails naming it. Orphan shards, written by a writer that died before
committing them, are deleted once that writer incarnation is no longer live.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from relax import objstore
from relax.transfer.consumer import load_group_state
from relax.transfer.manifest import check_shard_name
from relax.transfer.queue import TransferQueue
from relax.transfer.writers import WriterLease, split_key


def consumer_groups(queue: TransferQueue) -> list[str]:
    return objstore.list_dir(objstore.join(queue.url, "cursors"))


def retain(queue: TransferQueue, keep_from_step: Mapping[str, int] | None = None) -> list[str]:
    """Delete shards every group is done with; returns their names.

    ``keep_from_step[group]``: the first step of ``group`` that must stay replayable (the
    step after the oldest kept checkpoint). Samples consumed at that step or later, and
    samples not yet consumed by every group, keep their shards.
    """
    queue.refresh()
    keep_from_step = dict(keep_from_step or {})
    groups = {g: load_group_state(queue, g) for g in consumer_groups(queue)}
    by_shard: dict[str, list[str]] = defaultdict(list)
    for meta in queue.state.samples.values():
        for shard, _ in set(meta.locs.values()):
            by_shard[shard].append(meta.id)

    def done(sid: str) -> bool:
        for name, st in groups.items():
            if sid in st.dropped:
                continue
            step = st.consumed.get(sid)
            if step is None or step >= keep_from_step.get(name, st.last_step + 1):
                return False
        return True

    # with no consumer group yet, every committed sample is still needed
    # names from records must be of the layout, so no record can point retention outside shards/; orphans
    # are entries of the shards/ folder itself (temporary files of interrupted writes among them)
    deleted = [check_shard_name(shard, "retention") for shard, ids in sorted(by_shard.items())
               if groups and all(done(s) for s in ids)]
    deleted += _orphans(queue)
    for shard in deleted:
        objstore.delete(objstore.join(queue.url, "shards", shard))
    return deleted


def _orphans(queue: TransferQueue) -> list[str]:
    """Shards with no commit record whose writer incarnation is dead."""
    committed = set(queue.state.shards)
    leases = objstore.join(queue.url, "leases")
    out = []
    for key in objstore.list_dir(objstore.join(queue.url, "shards")):
        writer_id, incarnation = split_key(key)
        probe = WriterLease(leases, writer_id)
        holder = probe.holder()
        if holder and holder.get("incarnation") == incarnation and probe.holder_alive(holder):
            continue  # a live writer may be about to commit it
        for name in objstore.list_dir(objstore.join(queue.url, "shards", key)):
            shard = f"{key}/{name}"
            if shard not in committed:  # includes temporary files of interrupted local writes
                out.append(shard)
    return out
