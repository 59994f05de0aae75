"""`relax replay` prints the recorded consumption order, as text and as JSON lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "transfer"))

from transfer_helpers import ROLLOUT_FIELDS, rollout_group  # noqa: E402

from relax.transfer.consumer import ConsumerGroup  # noqa: E402
from relax.transfer.queue import TransferQueue  # noqa: E402

RELAX = str(Path(sys.executable).with_name("relax"))


def test_replay_order_text_and_json(tmp_path):
    p = TransferQueue(str(tmp_path), "run1", "rollouts").producer("rollout-0", ROLLOUT_FIELDS)
    for g in ("a", "b", "c"):
        p.put(rollout_group(g, policy_version=1))
    group = ConsumerGroup(TransferQueue(str(tmp_path), "run1", "rollouts"), "actor", ["tokens"], batch_groups=1)
    taken = [group.take(s, current_version=2, timeout=5).ids for s in range(3)]
    out = subprocess.run([RELAX, "replay", str(tmp_path), "run1", "--json"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert [r["ids"] for r in rows] == taken == [["a/0", "a/1"], ["b/0", "b/1"], ["c/0", "c/1"]]
    assert {r["group"] for r in rows} == {"actor"} and [r["step"] for r in rows] == [0, 1, 2]
    text = subprocess.run([RELAX, "replay", str(tmp_path), "run1"], capture_output=True, text=True).stdout
    assert text.splitlines()[0] == "# topic rollouts, group actor: 3 steps"
    assert "step      1  policy v2  2 samples (from versions [1])  b/0 b/1" in text


def test_replay_of_unknown_run_is_one_error_line(tmp_path):
    out = subprocess.run([RELAX, "replay", str(tmp_path), "nope"], capture_output=True, text=True)
    assert out.returncode == 2 and out.stderr.startswith("error: run 'nope' has no queue under")
