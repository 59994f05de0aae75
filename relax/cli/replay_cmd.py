"""``relax replay``: the exact consumption order of a run, step by step; ``--retrain``
re-executes the actor's steps from a checkpoint and compares them with the run's
(``relax.services.replay``).

A trainer re-executes a run on the same samples by asking its consumer group for the
recorded steps (``ConsumerGroup.take(step)`` returns them); this command shows that
order to a person, or as JSON lines to another program.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile

from relax import objstore
from relax.transfer.consumer import replay
from relax.transfer.errors import StoreError
from relax.transfer.queue import TransferQueue
from relax.transfer.retention import consumer_groups


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("replay", help="print the recorded consumption order of a run",
                       description="relax replay ROOT RUN [--topic T] [--group G] [--json] "
                                   "[--retrain STEP [--to STEP] [--into DIR]]")
    p.add_argument("root", help="the run root (any fsspec URL)")
    p.add_argument("run", help="run id")
    p.add_argument("--topic", default=None, help="queue topic (default: the only one, else required)")
    p.add_argument("--group", default=None, help="consumer group (default: every group of the topic)")
    p.add_argument("--json", action="store_true", help="one JSON object per step")
    p.add_argument("--retrain", type=int, default=None, metavar="STEP",
                   help="retrain the actor's recorded steps after checkpoint STEP in a scratch copy, and compare "
                        "each step's loss and gradient norm (and the final weights) with the run's")
    p.add_argument(
        "--to", type=int, default=None, metavar="STEP", help="last step to retrain (default: the run's last)"
    )
    p.add_argument("--into", default=None, metavar="DIR",
                   help="local folder for the copy (default: a temporary folder, deleted afterwards)")
    p.set_defaults(func=_replay)


def _replay(args: argparse.Namespace) -> int:
    if args.retrain is not None:
        return _retrain(args)
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


def _retrain(args: argparse.Namespace) -> int:
    """Exit 0 when every retrained step and the final weights match the run's, 1 otherwise."""
    from relax.services.replay import TERM_METRICS, Retrain  # torch and the models: only when retraining

    into = args.into or tempfile.mkdtemp(prefix="relax-retrain-")
    try:
        job = Retrain(args.root, args.run, args.retrain, into, args.to)
        if not args.json:
            print(f"# retraining steps {args.retrain + 1}..{job.to_step} of run {args.run} in {into}")
            print(f"{'step':>6} {'loss':>12} {'recorded':>12} {'grad norm':>11} {'recorded':>11} same  "
                  + "  ".join(TERM_METRICS))
        diverged = 0
        for c in job.steps():
            diverged += not c.same
            if args.json:
                print(json.dumps({"step": c.step, "loss": c.loss, "recorded_loss": c.recorded_loss,
                                  "grad_norm": c.grad_norm, "recorded_grad_norm": c.recorded_grad_norm,
                                  "same": c.same, **c.terms}))
            else:
                print(f"{c.step:>6} {c.loss:>12.5g} {_num(c.recorded_loss, 12)} {c.grad_norm:>11.4g} "
                      f"{_num(c.recorded_grad_norm, 11)} {'yes ' if c.same else 'NO  '}  "
                      + "  ".join(f"{c.terms[k]:.4g}" if k in c.terms else "-" for k in TERM_METRICS))
        w = job.weights
        if w is None:
            verdict = "the run's weights after the last step were deleted by retention: not compared"
        elif w.identical:
            verdict = f"weights after the last step: bit-identical to the run's version {w.version}"
        else:
            verdict = (f"weights after the last step DIFFER from the run's version {w.version}: "
                       f"max |diff| {w.max_abs_diff:.3g} in {w.worst_tensor}")
        summary = f"{diverged} of {job.to_step - args.retrain} steps diverged; {verdict}"
        print(json.dumps({"diverged_steps": diverged, "weights": w.__dict__ if w else None}) if args.json
              else f"# {summary}")
        return 1 if diverged or (w is not None and not w.identical) else 0
    finally:
        if args.into is None:
            shutil.rmtree(into, ignore_errors=True)


def _num(x: float | None, width: int) -> str:
    return f"{x:>{width}.5g}" if x is not None else f"{'-':>{width}}"
