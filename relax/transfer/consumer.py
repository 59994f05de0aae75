"""Consumer groups: exactly-once, staleness-bounded batches from a topic.

A group (``actor_train``) takes one batch per training step and records, before handing
it out, which sample ids that step consumed (``cursors/<group>/<writer>.<inc>/<seq>.json``).
Asking again for a recorded step returns the same samples, so a trainer that restarts
from a checkpoint at step c re-trains steps c+1.. on exactly what it saw before, then
continues with new data: nothing is consumed twice, nothing skipped. Samples too stale
to train on, or in a corrupt shard, are recorded as dropped with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from relax import objstore
from relax.transfer.errors import QueueTimeout, StoreError
from relax.transfer.manifest import SampleMeta
from relax.transfer.polling import Backoff
from relax.transfer.queue import TransferQueue
from relax.transfer.writers import RecordLog, WriterLease, read_records


@dataclass
class Batch:
    """One training step's samples; ``fields[name][i]`` belongs to ``ids[i]``."""

    step: int
    ids: list[str]
    groups: list[str]
    policy_versions: list[int]
    fields: dict[str, list[Any]]
    replayed: bool = False

    def __len__(self) -> int:
        return len(self.ids)

    def padded(self, name: str, pad: float = 0) -> tuple[np.ndarray, np.ndarray]:
        """A ragged field as a ``(batch, max_len, ...)`` array plus a boolean ``(batch, max_len)`` mask."""
        values = self.fields[name]
        longest = max(len(v) for v in values)
        out = np.full((len(values), longest, *values[0].shape[1:]), pad, dtype=values[0].dtype)
        mask = np.zeros((len(values), longest), dtype=bool)
        for i, v in enumerate(values):
            out[i, : len(v)] = v
            mask[i, : len(v)] = True
        return out, mask


@dataclass
class GroupState:
    """What a consumer group has done, folded from its records (all incarnations)."""

    steps: dict[int, dict[str, Any]] = field(default_factory=dict)
    consumed: dict[str, int] = field(default_factory=dict)  # sample id -> step
    dropped: dict[str, str] = field(default_factory=dict)  # sample id -> reason

    @property
    def last_step(self) -> int:
        return max(self.steps, default=-1)

    def apply(self, record: dict[str, Any]) -> None:
        for sid, reason in record.get("dropped", []):
            self.dropped.setdefault(sid, reason)
        if record["kind"] == "step" and record["step"] not in self.steps:
            self.steps[record["step"]] = record
            for sid in record["ids"]:
                self.consumed.setdefault(sid, record["step"])


def group_url(queue: TransferQueue, group: str) -> str:
    return objstore.join(queue.url, "cursors", group)


class GroupView:
    """A read-only, incrementally refreshed view of a group's records (all incarnations)."""

    def __init__(self, queue: TransferQueue, group: str):
        self.url = group_url(queue, group)
        self.state = GroupState()
        self._next: dict[str, int] = {}

    def refresh(self) -> GroupState:
        for key in objstore.list_dir(self.url):  # incarnation keys sort by start time
            for seq, record in read_records(objstore.join(self.url, key), self._next.get(key, 0)):
                self.state.apply(record)
                self._next[key] = seq + 1
        return self.state


def load_group_state(queue: TransferQueue, group: str) -> GroupState:
    """What ``group`` has consumed and dropped so far (used by replay, retention and tests)."""
    return GroupView(queue, group).refresh()


class ConsumerGroup:
    """The single live consumer of ``group`` on a topic (one writer per cursor log)."""

    def __init__(self, queue: TransferQueue, group: str, fields: Sequence[str], *, batch_groups: int | None = None,
                 token_budget: int | None = None, max_staleness: int = 1, flush_after_s: float = 1.0):
        if (batch_groups is None) == (token_budget is None):
            raise ValueError("give exactly one of batch_groups (complete prompt groups per step) or token_budget")
        self.queue, self.group, self.fields = queue, group, list(fields)
        self.batch_groups, self.token_budget = batch_groups, token_budget
        self.max_staleness = max_staleness
        self.flush_after_s = flush_after_s
        self.lease = WriterLease(objstore.join(queue.url, "leases"), f"group:{group}", queue.lease_timeout_s).acquire()
        self.state = load_group_state(queue, group)
        self.log = RecordLog(objstore.join(group_url(queue, group), self.lease.key), fsync=queue.fsync)
        # samples neither consumed nor dropped, by prompt group, in the order this consumer saw them
        self._open: dict[str, list[str]] = {}
        self._seen = 0

    @property
    def next_step(self) -> int:
        """The first step this group has not recorded: where a restarted run continues."""
        return self.state.last_step + 1

    def take(self, step: int, current_version: int, timeout: float | None = None) -> Batch:
        """The batch of ``step``: the recorded one if the step was taken before, else a new one.

        Waits (polling with backoff) until enough complete, fresh groups exist; raises
        ``QueueTimeout`` after ``timeout`` seconds.
        """
        if step in self.state.steps:
            return self._replay(step)
        if step != self.next_step:
            raise ValueError(f"group {self.group!r}: step {step} requested but the next new step is "
                             f"{self.next_step}; steps are taken in order")
        deadline = None if timeout is None else time.monotonic() + timeout
        first_try = time.monotonic()
        while True:
            self.lease.renew()
            self.queue.refresh()
            chosen, dropped = self._select(current_version, flush=time.monotonic() - first_try >= self.flush_after_s)
            if dropped:
                self._record({"kind": "drop", "dropped": dropped, "time": time.time()})
            if chosen:
                return self._deliver(step, current_version, chosen)
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                self.queue.check_gaps()  # a lost record, not a slow producer, is then the error to report
                raise QueueTimeout(f"group {self.group!r} step {step}: not enough complete groups with fields "
                                   f"{self.fields} within {timeout} s ({self.pending_count()} samples pending)")
            self.queue.wait_for_new(min(left, 1.0) if left is not None else 1.0)

    def steps_missing(self, field: str) -> list[int]:
        """Recorded steps with a sample that still lacks ``field``: the output of a role that
        died between recording a step and committing its column. Taking such a step again
        hands back the same samples, so the role recomputes and commits what was lost."""
        self.queue.refresh()
        return [step for step in sorted(self.state.steps)
                if any(field not in self.queue.state.samples[sid].locs for sid in self.state.steps[step]["ids"])]

    def pending_count(self) -> int:
        """Committed samples this group has neither consumed nor dropped."""
        done = self.state.consumed.keys() | self.state.dropped.keys()
        return sum(1 for sid in self.queue.state.samples if sid not in done)

    # -- selection --------------------------------------------------------------------------
    def _ingest(self) -> None:
        """Index samples that arrived since the last call (incremental: O(new samples))."""
        arrivals = self.queue.state.arrivals
        for sid in arrivals[self._seen:]:
            if sid not in self.state.consumed and sid not in self.state.dropped:
                self._open.setdefault(self.queue.state.samples[sid].group, []).append(sid)
        self._seen = len(arrivals)

    def _select(self, current_version: int, flush: bool) -> tuple[list[list[SampleMeta]], list[list[str]]]:
        """Walk open groups first-come first-served: drop stale ones, skip incomplete ones, verify
        the data of complete ones, and stop as soon as the batch is full."""
        self._ingest()
        samples = self.queue.state.samples
        chosen: list[list[SampleMeta]] = []
        dropped: list[list[str]] = []
        tokens = 0
        for gid in list(self._open):
            members = sorted((samples[sid] for sid in self._open[gid]), key=lambda m: m.order)
            oldest = min(m.policy_version for m in members)
            if current_version - oldest > self.max_staleness:
                reason = (f"stale: policy_version {oldest}, current {current_version}, "
                          f"max_staleness {self.max_staleness}")
                self._close(gid, members, dropped, reason)
                continue
            members = members[: members[0].group_size]
            if len(members) < members[0].group_size or not all(f in m.locs for m in members for f in self.fields):
                continue
            try:  # verify the data now, so a corrupt shard never enters a recorded step
                for shard in {m.locs[f][0] for m in members for f in self.fields}:
                    self.queue.load_shard(shard)
            except StoreError as e:
                self._close(gid, members, dropped, f"corrupt: {e}")
                continue
            if self.batch_groups is not None:
                chosen.append(members)
                if len(chosen) == self.batch_groups:
                    return chosen, dropped
            else:
                size = sum(m.num_tokens for m in members)
                if chosen and tokens + size > self.token_budget:
                    return chosen, dropped
                chosen.append(members)
                tokens += size
        # token mode: a partly filled budget is handed out once no more data came for flush_after_s
        return (chosen if (self.token_budget is not None and chosen and flush) else []), dropped

    def _close(self, gid: str, members: list[SampleMeta], dropped: list[list[str]] | None, reason: str = "") -> None:
        """Take ``members`` out of the open index (consumed, or dropped with ``reason``)."""
        ids = {m.id for m in members}
        if dropped is not None:
            dropped += [[m.id, reason] for m in members]
        rest = [sid for sid in self._open.get(gid, []) if sid not in ids]
        if rest:
            self._open[gid] = rest
        else:
            self._open.pop(gid, None)

    def _deliver(self, step: int, current_version: int, chosen: list[list[SampleMeta]]) -> Batch:
        ids = [m.id for members in chosen for m in members]
        for members in chosen:
            self._close(members[0].group, members, None)
        self._record({"kind": "step", "step": step, "ids": ids, "current_version": current_version,
                      "heads": dict(self.queue.state.heads), "time": time.time()})
        return self._batch(step, ids, replayed=False)

    def _replay(self, step: int) -> Batch:
        self.queue.refresh()
        ids = self.state.steps[step]["ids"]
        missing = [sid for sid in ids if sid not in self.queue.state.samples]
        if missing:
            raise StoreError(f"group {self.group!r} step {step}: recorded samples {missing[:3]} are not in the "
                             f"topic's manifest")
        return self._batch(step, ids, replayed=True)

    def _batch(self, step: int, ids: list[str], replayed: bool) -> Batch:
        metas = [self.queue.state.samples[sid] for sid in ids]
        return Batch(step, ids, [m.group for m in metas], [m.policy_version for m in metas],
                     self.queue.read(ids, self.fields), replayed)

    def _record(self, record: dict[str, Any]) -> None:
        self.log.append(record)
        self.state.apply(record)

    def close(self) -> None:
        self.lease.release()


def wait_for_capacity(queue: TransferQueue, group: str, batch_size: int, max_staleness: int, incoming: int,
                      in_flight: int = 0, timeout: float | None = None, view: GroupView | None = None) -> int:
    """Producer admission: block until ``unconsumed + in_flight + incoming <= (max_staleness+1) * batch_size``.

    ``unconsumed`` counts committed samples ``group`` has neither consumed nor dropped.
    Returns the number of samples that may still be admitted after ``incoming``. A producer
    that asks every batch passes its own ``view`` of the group, so each call reads only the
    cursor records written since the last one instead of all of them.
    """
    limit = (max_staleness + 1) * batch_size
    if incoming > limit:
        raise ValueError(
            f"{incoming} samples can never be admitted: the bound is (max_staleness + 1) * batch = {limit}"
        )
    deadline = None if timeout is None else time.monotonic() + timeout
    view = view or GroupView(queue, group)
    # consumption is recorded in the group's cursors, not the topic, so wait_for_new only
    # bounds the sleep here; the delay grows with the wait (polling.py)
    backoff = Backoff(queue.poll_interval_s, max(queue.poll_interval_s, queue.max_poll_interval_s))
    while True:
        queue.refresh()
        st = view.refresh()
        done = len(st.consumed.keys() | st.dropped.keys())
        unconsumed = len(queue.state.samples) - done
        room = limit - unconsumed - in_flight - incoming
        if room >= 0:
            return room
        if deadline is not None and time.monotonic() >= deadline:
            raise QueueTimeout(f"no capacity for {incoming} samples within {timeout} s: {unconsumed} unconsumed "
                               f"+ {in_flight} in flight, bound {limit}")
        queue.wait_for_new(backoff.next())


def replay(queue: TransferQueue, group: str) -> Iterator[dict[str, Any]]:
    """The recorded consumption of ``group``, step by step: ``{step, ids, current_version, ...}``."""
    st = load_group_state(queue, group)
    for step in sorted(st.steps):
        yield st.steps[step]


def trained_policy_versions(queue: TransferQueue, group: str, up_to_step: int,
                            after_step: int = -1) -> dict[int, int]:
    """How many samples of each policy version ``group`` consumed in steps
    ``after_step < step <= up_to_step``: what a checkpoint's lineage record stores."""
    queue.refresh()
    counts: dict[int, int] = {}
    for step, record in load_group_state(queue, group).steps.items():
        if after_step < step <= up_to_step:
            for sid in record["ids"]:
                pv = queue.state.samples[sid].policy_version
                counts[pv] = counts.get(pv, 0) + 1
    return dict(sorted(counts.items()))
