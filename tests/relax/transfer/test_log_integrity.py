"""What a reader does with a log or snapshot the store damaged: a lost record in the middle of a
writer's log is named (not a timeout about something else), and a torn newest snapshot falls back to
an older one or to the logs."""

from __future__ import annotations

import json
import logging

import pytest

from relax import objstore
from relax.transfer.columns import Field
from relax.transfer.consumer import ConsumerGroup
from relax.transfer.errors import StoreError
from relax.transfer.queue import TransferQueue

FIELDS = [Field("x", "int64", (None,))]


def filled(tmp_path, n: int) -> tuple[TransferQueue, str]:
    """A topic whose one writer committed ``n`` one-sample records; returns it and the writer's log URL."""
    q = TransferQueue(f"file://{tmp_path}", "r", "t")
    p = q.producer("w", FIELDS, tokens_field=None)
    for i in range(n):
        p.put([{"id": f"s{i}", "group": f"g{i}", "x": [i]}])
    log_url = objstore.join(q.url, "log", p.lease.key)
    p.close()
    return q, log_url


def test_a_lost_record_is_named_when_the_topic_opens(tmp_path):
    _, log_url = filled(tmp_path, 4)
    objstore.delete(objstore.join(log_url, "00000001.json"))
    with pytest.raises(StoreError, match=r"log w\.\S+ is missing records \[1\] while 2 later ones exist"):
        TransferQueue(f"file://{tmp_path}", "r", "t")


def test_a_consumer_that_times_out_on_a_gap_says_so(tmp_path):
    # the reader opened before the loss: it stops at the gap, and its wait ends with the gap, not a timeout
    q = TransferQueue(f"file://{tmp_path}", "r", "t")
    group = ConsumerGroup(q, "c", ["x"], batch_groups=3)
    _, log_url = filled(tmp_path, 3)
    objstore.delete(objstore.join(log_url, "00000000.json"))
    with pytest.raises(StoreError, match=r"is missing records \[0\]"):
        group.take(0, current_version=0, timeout=0.3)
    group.close()


def test_a_torn_newest_snapshot_falls_back_to_the_logs(tmp_path, caplog):
    q, _ = filled(tmp_path, 3)
    q.compact()
    p = q.producer("w2", FIELDS, tokens_field=None)
    p.put([{"id": "late", "group": "gl", "x": [9]}])
    p.close()
    newest = q.compact()
    expected = sorted(q.state.samples)
    objstore.write_bytes(objstore.join(q.url, "snapshots", f"{newest:08d}.json"), b'{"version": 2, "hea')
    with caplog.at_level(logging.WARNING):
        reopened = TransferQueue(f"file://{tmp_path}", "r", "t")
    assert f"skipping manifest version {newest}" in caplog.text and "not valid JSON" in caplog.text
    assert sorted(reopened.state.samples) == expected and reopened.snapshot_version == newest - 1
    with pytest.raises(StoreError, match=f"snapshots/{newest:08d}.json is not valid JSON"):
        reopened.state_at(newest)  # a checkpoint naming that version gets a named error


def test_a_record_that_is_not_an_object_is_named(tmp_path):
    _, log_url = filled(tmp_path, 1)
    objstore.write_bytes(objstore.join(log_url, "00000001.json"), json.dumps([1, 2]).encode())
    with pytest.raises(StoreError, match=r"record w\.\S+/1 is malformed: a list"):
        TransferQueue(f"file://{tmp_path}", "r", "t")
