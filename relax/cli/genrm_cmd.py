"""``relax genrm``: the generative reward model's tools.

``relax genrm train-judge --task largest --out DIR [--steps N]`` trains a tiny judge for a built-in
text task (relax.trainers.torch.judge_sft) on the policy's tokenizer, saves it as a Hugging Face
folder and prints one JSON line: its held-out agreement with the task's verifier and the ``genrm.*``
overrides that grade a run with it (``genrm.name_or_path=DIR genrm.verdict=boxed ...``).
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("genrm", help="generative reward model tools: train a tiny judge",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tools = p.add_subparsers(dest="tool", required=True)
    t = tools.add_parser("train-judge", help="train a tiny judge for a built-in text task")
    t.add_argument("--task", default="largest", help="a built-in single-turn text task (largest, arithmetic)")
    t.add_argument("--out", required=True, help="a local folder to write the judge to")
    t.add_argument("--steps", type=int, default=None, help="SFT steps (default: the module's TRAIN_STEPS)")
    t.add_argument("--tokenizer", default="bpe-tiny", help="the policy's tokenizer (the judge must share it)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-questions", type=int, default=128, help="held-out questions to measure it on")
    t.set_defaults(func=_train_judge)


def _train_judge(args: argparse.Namespace) -> int:
    from relax.cli.args import CommandError
    from relax.trainers.torch.judge_sft import (
        TRAIN_STEPS,
        judge_accuracy,
        judge_overrides,
        local_judge,
        text_task,
        train_judge,
    )

    try:
        text_task(args.task)
    except ValueError as e:
        raise CommandError(str(e)) from None
    steps = args.steps if args.steps is not None else TRAIN_STEPS
    trained = train_judge(args.out, args.task, steps, seed=args.seed, tokenizer=args.tokenizer)
    judge = local_judge(args.out, seed=args.seed)
    try:
        held_out = judge_accuracy(judge, args.task, args.eval_questions, seed=args.seed)
    finally:
        judge.close()
    print(json.dumps({"out": args.out, **{k: v for k, v in trained.items() if k != "loss_curve"},
                      "held_out": held_out, "overrides": judge_overrides(args.out)}))
    return 0
