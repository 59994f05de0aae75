"""``relax replay``: the exact consumption order of a run, step by step.

A trainer re-executes a run on the same samples by asking its consumer group for the
recorded steps (``ConsumerGroup.take(step)`` returns them); this command shows that
order to a person, or as JSON lines to another program.
"""

from __future__ import annotations

import argparse
import json

from relax import objstore
from relax.transfer.consumer import replay
from relax.transfer.errors import StoreError
from relax.transfer.queue import TransferQueue
from relax.transfer.retention import consumer_groups


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="print the recorded consumption order of a run",
                       description="relax replay ROOT RUN [--topic T] [--group G] [--json]")
    p.add_argument("root", help="the run root (any fsspec URL)")
    p.add_argument("run", help="run id")
    p.add_argument("--topic", default=None, help="queue topic (default: the only one, else required)")
    p.add_argument("--group", default=None, help="consumer group (default: every group of the topic)")
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    run_url = objstore.join(objstore.absolute_url(args.root), "runs", args.run)
    topics = objstore.list_dir(objstore.join(run_url, "queue"))
    if not topics:
        raise StoreError(f"run {args.run!r} has no queue under {run_url}; check the root and run id")
    topic = args.topic or (topics[0] if len(topics) == 1 else None)
    if topic not in topics:
        raise StoreError(f"choose a topic with --topic: {', '.join(topics)}")
    queue = TransferQueue(args.root, args.run, topic)
    groups = [args.group] if args.group else consumer_groups(queue)
    for group in groups:
        steps = list(replay(queue, group))
        if not steps:
            raise StoreError(f"consumer group {group!r} of topic {topic!r} recorded no steps")
        if not args.json:
            print(f"# topic {topic}, group {group}: {len(steps)} steps")
        for rec in steps:
            if args.json:
                print(json.dumps({"topic": topic, "group": group, "step": rec["step"], "ids": rec["ids"],
                                  "current_version": rec["current_version"], "heads": rec["heads"]}))
            else:
                versions = sorted({queue.state.samples[s].policy_version for s in rec["ids"]
                                   if s in queue.state.samples})
                print(f"step {rec['step']:>6}  policy v{rec['current_version']}  {len(rec['ids'])} samples "
                      f"(from versions {versions})  {' '.join(rec['ids'][:6])}{' ...' if len(rec['ids']) > 6 else ''}")
    return 0
