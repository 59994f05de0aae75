"""A producer or consumer process for the crash test; it resumes from the store on every start.

    python crash_worker.py producer ROOT GROUPS [PROGRESS]  # puts groups g0..g{GROUPS-1}, resuming after a kill
    python crash_worker.py consumer ROOT GROUPS [PROGRESS]  # consumes every group, 2 per step, resuming after a kill

After every commit it writes how many groups it has put or consumed so far (this incarnation's
and the earlier ones') to the file PROGRESS, so the test can kill it at a chosen point of its run.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from transfer_helpers import ROLLOUT_FIELDS, rollout_group  # noqa: E402

from relax.transfer.consumer import ConsumerGroup  # noqa: E402
from relax.transfer.queue import TransferQueue  # noqa: E402


def report(progress: str | None, groups: int) -> None:
    if progress:
        Path(progress + ".tmp").write_text(str(groups))
        os.replace(progress + ".tmp", progress)  # a reader never sees a half-written number


def produce(root: str, total: int, progress: str | None) -> None:
    producer = TransferQueue(root, "run", "rollouts").producer("rollout-0", ROLLOUT_FIELDS)
    nxt = (producer.last_meta() or {}).get("next", 0)  # what the previous incarnation committed
    while nxt < total:
        batch = [s for k in range(nxt, min(nxt + 2, total)) for s in rollout_group(f"g{k}", size=2)]
        nxt = min(nxt + 2, total)
        producer.put(batch, meta={"next": nxt})
        report(progress, nxt)
        time.sleep(0.02)


def consume(root: str, total: int, progress: str | None) -> None:
    group = ConsumerGroup(TransferQueue(root, "run", "rollouts", poll_interval_s=0.01), "actor", ["tokens"],
                          batch_groups=2)
    while len(group.state.consumed) < 2 * total:
        group.take(group.next_step, current_version=0, timeout=30)
        report(progress, len(group.state.consumed) // 2)


if __name__ == "__main__":
    role, root, total = sys.argv[1], sys.argv[2], int(sys.argv[3])
    (produce if role == "producer" else consume)(root, total, sys.argv[4] if len(sys.argv) > 4 else None)
