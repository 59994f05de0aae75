"""Bounded staleness, checked from the manifests of a concurrent producer/consumer run."""

from __future__ import annotations

import threading

import pytest
from transfer_helpers import ROLLOUT_FIELDS, rollout_group

from relax.transfer.consumer import ConsumerGroup, load_group_state, wait_for_capacity
from relax.transfer.queue import TransferQueue


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_no_consumed_sample_violates_max_staleness(tmp_path, max_staleness):
    root, steps, batch_groups, size = str(tmp_path), 12, 2, 2
    version = {"v": 0}  # the trainer's policy version; the producer stamps what it last "loaded"
    stop = threading.Event()

    def rollout():
        q = TransferQueue(root, "run", "rollouts", poll_interval_s=0.005)
        p = q.producer("rollout-0", ROLLOUT_FIELDS)
        k = 0
        while not stop.is_set():
            try:
                wait_for_capacity(q, "actor", batch_groups * size, max_staleness, incoming=size, timeout=0.2)
            except TimeoutError:
                continue
            p.put(rollout_group(f"g{k}", size=size, policy_version=version["v"]))
            k += 1

    producer = threading.Thread(target=rollout)
    producer.start()
    try:
        group = ConsumerGroup(TransferQueue(root, "run", "rollouts", poll_interval_s=0.005), "actor", ["tokens"],
                              batch_groups=batch_groups, max_staleness=max_staleness)
        for step in range(steps):
            group.take(step, current_version=version["v"], timeout=30)
            version["v"] += 1  # one optimizer step = one new policy version
    finally:
        stop.set()
        producer.join()
    q = TransferQueue(root, "run", "rollouts")
    st = load_group_state(q, "actor")
    lags = [rec["current_version"] - q.state.samples[sid].policy_version
            for rec in st.steps.values() for sid in rec["ids"]]
    assert len(st.steps) == steps and len(lags) == steps * batch_groups * size
    assert max(lags) <= max_staleness and min(lags) >= 0
    if max_staleness == 0:
        assert set(lags) == {0}  # strictly on-policy
    for sid, reason in st.dropped.items():  # every drop is explained and really was too stale
        assert reason.startswith("stale: ")
        assert q.state.samples[sid].policy_version < steps - max_staleness
