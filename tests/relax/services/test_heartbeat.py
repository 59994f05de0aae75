"""Heartbeats and the hang watch, on the store: what the supervisor decides from a role's marks."""

from __future__ import annotations

import json
import time

import pytest

from relax import liveness, objstore
from relax.services.heartbeat import HangWatch, HeartbeatWriter, heartbeat_url, last_progress, read_heartbeat
from relax.transfer.polling import Backoff
from tests.polling import wait_until


def test_a_writer_publishes_the_last_mark_and_the_watch_reads_it(any_url):
    run = objstore.join(any_url, "runs", "r")
    writer = HeartbeatWriter(run, "advantage", attempt=2, interval_s=0.05)
    try:
        liveness.mark(liveness.WORKING, step=7)
        wait_until(lambda: (read_heartbeat(run, "advantage") or {}).get("step") == 7, 10, interval=0.02,
                   what="the heartbeat to carry the mark")
    finally:
        writer.stop()
    beat = read_heartbeat(run, "advantage")
    assert beat["attempt"] == 2 and beat["state"] == liveness.WORKING and beat["progress_at"] <= beat["written_at"]
    shown = last_progress(run, "advantage", now=beat["progress_at"] + 12.5)
    assert shown["progress_s"] == 12.5 and shown["step"] == 7 and shown["attempt"] == 2


def test_the_watch_counts_from_the_last_mark_of_this_attempt_else_from_the_start(tmp_path):
    run = f"file://{tmp_path}/runs/r"
    watch = HangWatch(run, timeout_s=10.0, check_s=0.0)
    # no heartbeat yet: the start is the last progress (11 s ago > 10 s)
    assert watch.stalled("actor", 0, started_at=100.0, now=111.0) == pytest.approx(11.0)
    assert watch.stalled("actor", 0, started_at=100.0, now=109.0) is None
    beat = {"role": "actor", "attempt": 0, "progress_at": 105.0, "written_at": 120.0, "state": "working"}
    objstore.write_bytes(heartbeat_url(run, "actor"), json.dumps(beat).encode())
    # a mark at 105 moves the count: 114 - 105 = 9 s, not hung; 116 - 105 = 11 s, hung
    assert watch.stalled("actor", 0, started_at=100.0, now=114.0) is None
    assert watch.stalled("actor", 0, started_at=100.0, now=116.0) == pytest.approx(11.0)
    # the restarted attempt (1) started at 112: attempt 0's old mark says nothing of it
    assert watch.stalled("actor", 1, started_at=112.0, now=116.0) is None
    assert HangWatch(run, timeout_s=0.0, check_s=0.0).stalled("actor", 0, 0.0, now=1e12) is None  # 0 = off


def test_a_wait_that_polls_is_progress_and_a_heartbeat_not_ours_is_ignored(tmp_path):
    liveness.reset()
    before = liveness.last().at
    time.sleep(0.01)
    Backoff(0.01, 0.1).next()  # every wait of the queue, a consumer group and the weight store polls this way
    assert liveness.last().at > before and liveness.last().state == liveness.WAITING
    run = f"file://{tmp_path}/runs/r"
    for body in (b"not json", b'{"role": "rollout", "attempt": 0}', b'{"role": "actor", "attempt": "0", '
                 b'"progress_at": 1, "written_at": 1}', b'{"role": "actor", "attempt": 0, "progress_at": NaN, '
                 b'"written_at": 1}'):
        objstore.write_bytes(heartbeat_url(run, "actor"), body)
        assert read_heartbeat(run, "actor") is None, body
    with pytest.raises(ValueError, match="no role '../x'"):
        heartbeat_url(run, "../x")
