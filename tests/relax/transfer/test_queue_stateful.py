"""Hypothesis state machine: random interleavings of put, add-fields, take, crash and restart,
checked against a plain in-memory model of what the queue must contain and hand out."""

from __future__ import annotations

import uuid

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transfer_helpers import ADV, ROLLOUT_FIELDS, rollout_group

from relax import objstore
from relax.transfer.columns import encode_shard
from relax.transfer.consumer import ConsumerGroup, load_group_state
from relax.transfer.errors import QueueTimeout
from relax.transfer.queue import TransferQueue


class QueueMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.root = f"memory://stateful-{uuid.uuid4().hex}"
        self.producer = self._queue().producer("rollout", ROLLOUT_FIELDS)
        self.adder = self._queue().producer("advantage", [ADV])
        self.consumer = self._consumer()
        # the model
        self.groups: dict[str, int] = {}  # committed group -> size, in commit order
        self.with_adv: set[str] = set()  # sample ids that have advantages
        self.steps: list[list[str]] = []  # ids handed out per step
        self.counter = 0

    def _queue(self) -> TransferQueue:
        return TransferQueue(self.root, "run", "rollouts", poll_interval_s=0.001)

    def _consumer(self) -> ConsumerGroup:
        return ConsumerGroup(self._queue(), "actor", ["tokens", "advantages"], batch_groups=1)

    @property
    def consumed(self) -> set[str]:
        return {sid for step in self.steps for sid in step}

    @rule(size=st.integers(1, 3))
    def put(self, size):
        group = f"g{self.counter}"
        self.counter += 1
        self.producer.put(rollout_group(group, size=size))
        self.groups[group] = size

    @rule(data=st.data())
    def add_advantages(self, data):
        lacking = [f"{g}/{i}" for g, n in self.groups.items() for i in range(n) if f"{g}/{i}" not in self.with_adv]
        if not lacking:
            return
        chosen = data.draw(st.lists(st.sampled_from(lacking), min_size=1, max_size=4, unique=True))
        self.adder.add_fields({sid: {"advantages": np.zeros(3, np.float32)} for sid in chosen})
        self.with_adv |= set(chosen)

    @rule()
    def take(self):
        ready = [g for g, n in self.groups.items()
                 if all(f"{g}/{i}" in self.with_adv for i in range(n)) and f"{g}/0" not in self.consumed]
        step = len(self.steps)
        try:
            batch = self.consumer.take(step, current_version=0, timeout=0)
        except QueueTimeout:
            assert not ready, f"queue had nothing to give but the model has {ready}"
            return
        expected = [f"{ready[0]}/{i}" for i in range(self.groups[ready[0]])]
        assert batch.ids == expected
        self.steps.append(batch.ids)

    @rule()
    def crash_producer_mid_put(self):
        # the shard reaches the store, the commit record never does: it must stay invisible
        columns = {f.name: [f.check(v[f.name], "x") for v in rollout_group("ghost")] for f in ROLLOUT_FIELDS}
        blob = encode_shard(columns, {f.name: f for f in ROLLOUT_FIELDS}, ["ghost/0", "ghost/1"])
        objstore.write_bytes(objstore.join(self.producer.queue.url, "shards", self.producer.lease.key,
                                           f"{self.producer.log.next_seq:08d}.safetensors"), blob)
        self.producer.lease.release()
        self.producer = self._queue().producer("rollout", ROLLOUT_FIELDS)

    @rule()
    def restart_consumer(self):
        self.consumer.lease.release()  # the process is gone; its records stay
        self.consumer = self._consumer()
        assert self.consumer.next_step == len(self.steps)

    @precondition(lambda self: self.steps)
    @rule(data=st.data())
    def replay_a_recorded_step(self, data):
        step = data.draw(st.integers(0, len(self.steps) - 1))
        assert self.consumer.take(step, current_version=0).ids == self.steps[step]

    @invariant()
    def store_matches_model(self):
        fresh = self._queue()
        committed = {f"{g}/{i}" for g, n in self.groups.items() for i in range(n)}
        assert set(fresh.state.samples) == committed
        assert {sid for sid, m in fresh.state.samples.items() if "advantages" in m.locs} == self.with_adv
        recorded = load_group_state(fresh, "actor")
        assert [recorded.steps[s]["ids"] for s in sorted(recorded.steps)] == self.steps
        assert len(recorded.consumed) == sum(len(s) for s in self.steps)  # nobody consumed twice


TestQueueMachine = QueueMachine.TestCase
TestQueueMachine.settings = settings(max_examples=40, stateful_step_count=25, deadline=None)
