"""``relax run`` and ``relax eval``: the whole pipeline, or one evaluation, without Flyte.

``relax run [preset|file] [key=value ...]`` does what the ``omni_rl`` workflow does, in this
process: snapshot, format warm-start, evaluate, train, evaluate, lineage; it prints the
before/after table (``relax run omni-cpu`` is ``make run`` without Flyte). Running it again
resumes (every step is idempotent on the root). ``--json`` ends with one JSON object of the
scores, for scripts comparing recipes across seeds.

``relax eval [preset|file] [key=value ...] [--checkpoint URL] [--show N]`` prints the greedy held-out
accuracy of a checkpoint (default: the model RL would start from); ``--show N`` also prints N of the
held-out prompts (taken in turn from each task) with the policy's responses and their rewards, which
is how to see why a model scores 0: no answer in the expected format, or a wrong one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json

from relax.cli.args import config_from_args


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("run", help="the whole pipeline: snapshot, warm start, evaluate, train, evaluate",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", help="[preset or config file] then key=value overrides")
    p.add_argument("--eval-limit", type=int, default=None, help="held-out prompts per task (default: all)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--json", action="store_true", help="end with one JSON line of the scores")
    p.set_defaults(func=_run)

    e = sub.add_parser("eval", help="greedy held-out accuracy of a checkpoint")
    e.add_argument("args", nargs="*", help="[preset or config file] then key=value overrides")
    e.add_argument("--checkpoint", default="", help="a checkpoint folder URL (default: the model RL starts from)")
    e.add_argument("--limit", type=int, default=None, help="held-out prompts per task (default: all)")
    e.add_argument("--show", type=_count, default=0, metavar="N",
                   help="also print N held-out prompts with the policy's responses and their rewards")
    e.add_argument("--json", action="store_true", help="print the report as JSON")
    e.set_defaults(func=_eval)


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a count of prompts (0, 1, 2, ...)")
    return int(text)


def _run(args: argparse.Namespace) -> int:
    from relax import pipeline  # torch and transformers: only when this sub-command runs

    cfg = config_from_args(args.args)
    result = pipeline.run(cfg, progress=not args.no_progress, eval_limit=args.eval_limit)
    s = result.train
    print(f"run {s.run_id}: {s.steps} actor steps on data {result.snapshot.id}, training reward "
          f"{s.reward_first:.3f} -> {s.reward_last:.3f}")
    print(result.after.table(result.before))
    print(f"checkpoint: {s.checkpoint}\ncurves and metrics: {s.report_dir}\n{result.lineage_text}")
    if args.json:
        print(json.dumps({"run_id": s.run_id, "steps": s.steps, "checkpoint": s.checkpoint,
                          "before": result.before.by_modality, "after": result.after.by_modality,
                          "after_by_kind": result.after.by_kind, "confusion": result.after.confusion}))
    return 0


def _eval(args: argparse.Namespace) -> int:
    from relax import pipeline  # torch and transformers: only when this sub-command runs

    cfg = config_from_args(args.args)
    report = pipeline.evaluate(cfg, args.checkpoint, limit=args.limit)
    shown = report.sample_examples(args.show)
    if args.json:
        print(json.dumps({"checkpoint": args.checkpoint, "accuracy": report.accuracy, "n": report.n,
                          "by_modality": report.by_modality, "by_kind": report.by_kind,
                          **({"examples": [dataclasses.asdict(e) for e in shown]} if args.show else {})}))
    else:
        print(report.table())
        if args.show:
            print(f"\n{len(shown)} of {len(report.examples)} held-out prompts, answered greedily:")
        for e in shown:
            prompt = e.prompt if len(e.prompt) <= PROMPT_SHOWN else e.prompt[:PROMPT_SHOWN] + "..."
            print(f"\n[{e.task}] {e.id}  reward {e.reward:.3f}{f'  (reward error: {e.error})' if e.error else ''}\n"
                  f"  prompt:   {prompt!r}\n  answer:   {e.answer!r}\n  response: {e.response!r}")
    return 0


PROMPT_SHOWN = 300  # characters of a prompt --show prints; the response is printed whole
