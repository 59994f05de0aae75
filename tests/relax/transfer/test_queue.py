"""TransferQueue on file://, memory:// and s3:// (moto): commits, fields, manifests, writers."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from transfer_helpers import ADV, ROLLOUT_FIELDS, rollout_group

from relax import objstore
from relax.transfer.columns import Field
from relax.transfer.errors import SchemaError, StoreError, WriterConflict
from relax.transfer.manifest import TopicState
from relax.transfer.queue import TransferQueue, samples_of
from tests.polling import wait_until


def test_put_then_read_from_another_reader(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    assert p.put(rollout_group("g0", size=3)) == ["g0/0", "g0/1", "g0/2"]
    reader = TransferQueue(any_url, "run", "rollouts")
    assert samples_of(reader.state, ["tokens"]) == ["g0/0", "g0/1", "g0/2"]
    data = reader.read(["g0/2", "g0/0"], ["tokens", "reward"])
    assert data["tokens"][0].tolist() == [2, 3, 4] and data["tokens"][1].tolist() == [0, 1, 2]
    assert [float(r) for r in data["reward"]] == [2.0, 0.0]
    meta = reader.state.samples["g0/1"]
    assert (meta.group, meta.group_size, meta.policy_version, meta.num_tokens) == ("g0", 3, 0, 3)


def test_later_stage_adds_fields(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    q.producer("rollout-0", ROLLOUT_FIELDS).put(rollout_group("g0") + rollout_group("g1"))
    adv = q.producer("advantage", [ADV])
    adv.add_fields({"g0/0": {"advantages": np.array([0.5, 0.5, 0.5], np.float32)},
                    "g0/1": {"advantages": np.array([-0.5, -0.5, -0.5], np.float32)}})
    reader = TransferQueue(any_url, "run", "rollouts")
    assert samples_of(reader.state, ["tokens", "advantages"]) == ["g0/0", "g0/1"]  # g1 has no advantages yet
    assert reader.read(["g0/1"], ["advantages"])["advantages"][0].tolist() == [-0.5, -0.5, -0.5]
    assert [f.name for f in reader.schema().fields] == ["advantages", "tokens", "logprobs", "reward"]


def test_schema_violation_writes_nothing(tmp_path):
    q = TransferQueue(str(tmp_path), "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    bad = rollout_group("g0")
    bad[1]["logprobs"] = np.zeros(3, np.float64)
    with pytest.raises(SchemaError, match="sample 'g0/1' field 'logprobs': dtype float64 contradicts"):
        p.put(bad)
    missing = rollout_group("g1")
    del missing[0]["reward"]
    with pytest.raises(SchemaError, match=r"sample 'g1/0': missing fields \['reward'\]"):
        p.put(missing)
    with pytest.raises(SchemaError, match="appears twice"):
        p.put(rollout_group("g2") + rollout_group("g2"))
    assert not (tmp_path / "runs/run/queue/rollouts/shards").exists()
    assert not (tmp_path / "runs/run/queue/rollouts/log").exists()


def test_contradicting_declaration_is_refused(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    q.producer("rollout-0", ROLLOUT_FIELDS)
    with pytest.raises(SchemaError, match="field 'tokens' is declared as"):
        q.producer("rollout-1", [Field("tokens", "int32", (None,))])


def test_unwritable_root_is_named(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(StoreError) as err:
        TransferQueue(f"file://{blocker}/root", "run", "rollouts").producer("rollout-0", ROLLOUT_FIELDS)
    assert str(blocker) in str(err.value)


def test_second_live_writer_refuses_naming_the_first(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    first = q.producer("rollout-0", ROLLOUT_FIELDS)
    with pytest.raises(WriterConflict) as err:
        TransferQueue(any_url, "run", "rollouts").producer("rollout-0", ROLLOUT_FIELDS)
    assert "writer 'rollout-0' is already live" in str(err.value)
    assert first.lease.incarnation in str(err.value) and "pid" in str(err.value)
    first.close()
    second = q.producer("rollout-0", ROLLOUT_FIELDS)  # released: the id is free again
    assert second.lease.incarnation != first.lease.incarnation


def test_dead_writer_is_taken_over(tmp_path):
    # A writer process killed with SIGKILL leaves its lease behind; its pid is gone, so a restart proceeds.
    code = ("import sys; sys.path.insert(0, %r); from transfer_helpers import *; from relax.transfer.queue import "
            "TransferQueue; p = TransferQueue(%r, 'run', 't').producer('w', ROLLOUT_FIELDS); "
            "p.put(rollout_group('g0')); print('ready', flush=True); import time; time.sleep(60)")
    proc = subprocess.Popen([sys.executable, "-c", code % (str(Path(__file__).parent), str(tmp_path))],
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    with pytest.raises(WriterConflict):
        TransferQueue(str(tmp_path), "run", "t").producer("w", ROLLOUT_FIELDS)
    proc.kill()
    proc.wait()
    proc.stdout.close()
    p = TransferQueue(str(tmp_path), "run", "t").producer("w", ROLLOUT_FIELDS)
    p.put(rollout_group("g1"))
    assert sorted(TransferQueue(str(tmp_path), "run", "t").state.samples) == ["g0/0", "g0/1", "g1/0", "g1/1"]


def test_restarted_writer_gets_a_new_log_and_finds_its_progress(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("g0"), meta={"dataset_cursor": 1})
    p.put(rollout_group("g1"), meta={"dataset_cursor": 2})
    p.close()
    again = TransferQueue(any_url, "run", "rollouts").producer("rollout-0", ROLLOUT_FIELDS)
    assert again.last_meta() == {"dataset_cursor": 2}
    again.put(rollout_group("g2"), meta={"dataset_cursor": 3})
    assert again.last_meta() == {"dataset_cursor": 3}
    logs = objstore.list_dir(objstore.join(q.url, "log"))
    assert len(logs) == 2 and all(name.startswith("rollout-0.") for name in logs)


def test_manifest_snapshot_is_the_fold_of_the_logs(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("g0"))
    assert q.compact() == 1
    p.put(rollout_group("g1"))
    q.producer("advantage", [ADV]).add_fields({"g0/0": {"advantages": np.zeros(3, np.float32)}})
    assert q.compact() == 2
    reopened = TransferQueue(any_url, "run", "rollouts")  # starts from snapshot 2
    assert reopened.snapshot_version == 2
    from_logs = _fold_logs(q)
    assert json.dumps(reopened.state.to_json(), sort_keys=True) == json.dumps(from_logs.to_json(), sort_keys=True)
    assert sorted(q.state_at(1).samples) == ["g0/0", "g0/1"]
    with pytest.raises(StoreError, match="no manifest version 9"):
        q.state_at(9)


def _fold_logs(q: TransferQueue, heads: dict[str, int] | None = None) -> TopicState:
    from relax.transfer.writers import read_records

    st = TopicState()
    for key in objstore.list_dir(objstore.join(q.url, "log")):
        for seq, record in read_records(objstore.join(q.url, "log", key)):
            if heads is not None and seq > heads.get(key, -1):
                break
            st.apply(key, seq, record)
    return st


def _snapshot(q: TransferQueue, version: int) -> dict:
    return json.loads(objstore.read_bytes(objstore.join(q.url, "snapshots", f"{version:08d}.json")))


def test_until_the_topic_doubles_a_snapshot_is_a_delta_on_the_last_full_one(any_url):
    q = TransferQueue(any_url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    adv = q.producer("advantage", [ADV])
    p.put(rollout_group("g0"))
    assert q.compact() == 1  # the first: full, 2 samples
    adv.add_fields({"g0/0": {"advantages": np.zeros(3, np.float32)}})
    p.put(rollout_group("g1", size=1))
    assert q.compact() == 2  # 3 samples < 2 x 2: heads and base only
    p.put(rollout_group("g2", size=1))
    assert q.compact() == 3  # 4 samples: full again
    p.put(rollout_group("g3", size=2))
    assert q.compact() == 4  # 6 < 2 x 4: a delta on 3
    p.put(rollout_group("g4", size=1))  # after the last snapshot: only the log has it
    assert [("base" in _snapshot(q, v), _snapshot(q, v).get("base")) for v in (1, 2, 3, 4)] == \
        [(False, None), (True, 1), (False, None), (True, 3)]
    assert "samples" not in _snapshot(q, 2)
    # a delta's state is its base plus the log records up to its heads, as if folded from the logs
    for v in (2, 4):
        want = _fold_logs(q, _snapshot(q, v)["heads"])
        assert json.dumps(q.state_at(v).to_json(), sort_keys=True) == json.dumps(want.to_json(), sort_keys=True)
    assert sorted(q.state_at(2).samples) == ["g0/0", "g0/1", "g1/0"]
    assert "advantages" in q.state_at(2).samples["g0/0"].locs
    reopened = TransferQueue(any_url, "run", "rollouts")  # opens from the delta, then reads newer records
    assert reopened.snapshot_version == 4
    assert json.dumps(reopened.state.to_json(), sort_keys=True) == json.dumps(_fold_logs(q).to_json(), sort_keys=True)
    assert list(reopened.state.samples) == [
        m.id for m in sorted(reopened.state.samples.values(), key=lambda m: m.order)
    ]
    assert reopened.compact() == 5 and _snapshot(reopened, 5)["base"] == 3  # 7 < 2 x 4: it knows its base


def test_a_delta_whose_log_lost_records_names_the_log(tmp_path):
    url = f"file://{tmp_path}"
    q = TransferQueue(url, "run", "rollouts")
    p = q.producer("rollout-0", ROLLOUT_FIELDS)
    p.put(rollout_group("g0", size=4))
    q.compact()
    p.put(rollout_group("g1", size=1))
    assert q.compact() == 2
    (key,) = objstore.list_dir(objstore.join(q.url, "log"))
    objstore.delete(objstore.join(q.url, "log", key, "00000001.json"))
    with pytest.raises(StoreError, match=f"manifest version 2 names record 1 of log {key}, which ends at 0"):
        q.state_at(2)


def test_in_process_consumer_is_woken_at_once(tmp_path):
    # The notification fast path: a waiting reader in the same process sees a commit without polling delay.
    import threading

    from relax.transfer.queue import InProcessNotifier

    notifier = InProcessNotifier()  # the default kind, this test's own: no other waiter shares it
    q = TransferQueue(str(tmp_path), "run", "t", poll_interval_s=60.0, max_poll_interval_s=60.0, notifier=notifier)
    p = TransferQueue(str(tmp_path), "run", "t", notifier=notifier).producer("w", ROLLOUT_FIELDS)
    seen = []
    t = threading.Thread(target=lambda: seen.append(q.wait_for_new(timeout=120.0)), daemon=True)
    t.start()
    # the reader has found nothing and is blocked in its 60 s wait: only a notification ends it early
    wait_until(lambda: notifier._cond(q.url)._waiters, what="the reader waiting on the notifier")
    p.put(rollout_group("g0"))
    t.join(timeout=30.0)  # without the wake-up the reader would sleep its full 60 s poll interval
    assert seen == [True]


def test_from_config_and_a_custom_notifier(tmp_path):
    from relax.config import load_config

    class Counting:
        """A stand-in for a cluster-wide notifier: records notifications, never waits long."""

        def __init__(self):
            self.notified: list[str] = []

        def notify(self, topic_url):
            self.notified.append(topic_url)

        def wait(self, topic_url, timeout):
            time.sleep(min(timeout, 0.01))

    cfg = load_config(None, [f"root={tmp_path}", "run_id=exp", "queue.poll_interval_s=0.2", "queue.fsync=true"])
    notifier = Counting()
    q = TransferQueue.from_config(cfg, "rollouts", notifier=notifier)
    assert q.url == f"file://{tmp_path}/runs/exp/queue/rollouts"
    assert (q.poll_interval_s, q.fsync) == (0.2, True)
    q.producer("w", ROLLOUT_FIELDS).put(rollout_group("g0"))
    assert notifier.notified == [q.url]
