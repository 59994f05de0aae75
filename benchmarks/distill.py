"""On-policy distillation against RL from the reward alone: held-out accuracy per student sample.

1. A teacher: a bigger tiny Qwen2 (``--teacher-hidden``, 3 layers) supervised on ``--task``'s
   correct answers (its train split's oracle responses) until its greedy held-out accuracy reaches
   0.9 (or ``--teacher-steps`` run out; the figure is reported either way).
2. Students, a tiny Qwen2 (``--student-hidden`` x ``--student-layers``) from the same format
   warm-start, at the same settings and seed (``--modes``): ``rl`` (GRPO on the verifier's reward),
   ``distill`` (``algorithm.mode=distill``: the per-token negative reverse KL to the teacher is the
   whole advantage; the reward is not used) and ``distill_topk`` (the same, plus the exact forward KL
   over the teacher's top ``--topk`` tokens at every trained position, ``algorithm.distill_topk``).
   Every checkpoint is evaluated on the held-out split afterwards; the curve is accuracy against
   student samples generated (steps x prompts_per_step x n_samples_per_prompt).

    python benchmarks/distill.py [--quick]

Writes distill.json and the distill table to the untracked results folder (``--update-docs``:
benchmarks/results/distill.json and docs/benchmarks.md; see output.py). Last line: one JSON object
with the teacher's accuracy and each student's samples to reach ``--target`` (null if never).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from output import Output, add_arguments

from relax.config import load_config
from relax.pipeline import evaluate, train_run, warm_start
from relax.services.policy import build_model
from relax.services.run_context import RunContext


def common(args: argparse.Namespace, root: str) -> list[str]:
    return [f"root={root}", f"data.tasks=[{args.task}]", f"data.eval_per_task={args.eval}",
            f"trainer.checkpoint_every={args.every}", "trainer.lr=2e-3", "trainer.sft_steps=120",
            "rollout.max_new_tokens=8", "algorithm.entropy_coef=0.01"]


def train_teacher(args: argparse.Namespace, root: str) -> dict:
    """A teacher supervised on the train split's correct answers (the task's oracle responses), in stages of
    ``--teacher-every`` steps until it reaches 0.9 held out (or ``--teacher-steps`` run out)."""
    import random

    from relax.data.suite import TASKS
    from relax.trainers.checkpoint.trainer_state import save_checkpoint
    from relax.trainers.torch.batch import RolloutBatch
    from relax.trainers.torch.sft import demonstration_tokens
    from relax.trainers.torch.trainer import TorchTrainer, sft_loss

    cfg = load_config("tiny-cpu", [*common(args, root), "run_id=teacher", f"model.hidden_size={args.teacher_hidden}",
                                   "model.num_layers=3"])
    ctx = RunContext(cfg)
    model, _ = build_model(ctx)
    train, rng = ctx.split("train"), random.Random(0)
    trainer = TorchTrainer(model, lr=2e-3, warmup_steps=0, total_steps=args.teacher_steps, layout="pack")
    t0 = time.perf_counter()
    steps, accuracy, ckpt = 0, 0.0, ""
    while steps < args.teacher_steps and accuracy < 0.9:
        for _ in range(args.teacher_every):
            demos = [demonstration_tokens(s, TASKS[s.task].oracle_response(s), ctx.tokenizer)
                     for s in (train[rng.randrange(len(train))] for _ in range(64))]
            trainer.step(RolloutBatch(ids=[str(i) for i in range(len(demos))], input_ids=[d[0] for d in demos],
                                      loss_mask=[d[1] for d in demos]), sft_loss)
        steps += args.teacher_every
        ckpt = save_checkpoint(f"{root}/teacher/step-{steps:06d}", model, meta={"kind": "teacher", "steps": steps})
        accuracy = evaluate(cfg, ckpt).accuracy[args.task]
        print(f"teacher: {steps} supervised steps, held-out {accuracy:.3f}", flush=True)
    return {"checkpoint": ckpt, "steps": steps, "accuracy": accuracy, "hidden_size": args.teacher_hidden,
            "num_layers": 3, "train_s": time.perf_counter() - t0}


def student(args: argparse.Namespace, root: str, mode: str, teacher: dict) -> dict:
    extra = [] if mode == "rl" else [
        "algorithm.mode=distill", f"algorithm.distill_coef={args.distill_coef}", "teacher.name_or_path=tiny-qwen2",
        f"algorithm.distill_topk={args.topk if mode == 'distill_topk' else 0}",
        f"teacher.hidden_size={teacher['hidden_size']}", f"teacher.num_layers={teacher['num_layers']}",
        f"teacher.checkpoint={teacher['checkpoint']}"]
    cfg = load_config(
        "tiny-cpu",
        [
            *common(args, root),
            f"run_id=student-{mode}",
            f"trainer.total_steps={args.steps}",
            f"model.hidden_size={args.student_hidden}",
            f"model.num_layers={args.student_layers}",
            *extra,
            *args.overrides,
        ],
    )
    init = warm_start(cfg, RunContext(cfg).snapshot_info.id)
    per_step = cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt
    t0 = time.perf_counter()
    summary = train_run(cfg, init_checkpoint=init, progress=False)
    train_s = time.perf_counter() - t0
    curve = [{"samples": 0, "accuracy": evaluate(cfg, init).accuracy[args.task]}]
    for step in range(args.every, args.steps + 1, args.every):
        report = evaluate(cfg, f"{summary.run_url}/checkpoints/step-{step - 1:06d}")
        curve.append({"samples": step * per_step, "accuracy": report.accuracy[args.task]})
        print(f"student {mode}: {step} steps, held-out {curve[-1]['accuracy']:.3f}", flush=True)
    reached = next((c["samples"] for c in curve if c["accuracy"] >= args.target), None)
    return {"mode": mode, "curve": curve, "samples_to_target": reached, "train_s": train_s,
            "samples_per_step": per_step}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="a few steps: checks the script, not learning")
    ap.add_argument("--task", default="largest")
    ap.add_argument("--teacher-hidden", type=int, default=96)
    ap.add_argument("--teacher-steps", type=int, default=400, help="most supervised teacher steps")
    ap.add_argument("--teacher-every", type=int, default=50, help="teacher steps between evaluations")
    ap.add_argument("--student-hidden", type=int, default=96)
    ap.add_argument("--student-layers", type=int, default=3)
    ap.add_argument("--distill-coef", type=float, default=1.0)
    ap.add_argument("--topk", type=int, default=8, help="algorithm.distill_topk of the distill_topk student")
    ap.add_argument("--modes", nargs="+", default=["rl", "distill", "distill_topk"],
                    choices=["rl", "distill", "distill_topk"], help="the students to train")
    ap.add_argument("--steps", type=int, default=600, help="student steps")
    ap.add_argument("--every", type=int, default=60, help="student steps between evaluated checkpoints")
    ap.add_argument("--eval", type=int, default=64, help="held-out prompts")
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("overrides", nargs="*", help="extra config overrides key=value for both students")
    add_arguments(ap)
    args = ap.parse_args()
    if args.quick:
        args.teacher_steps, args.teacher_every, args.steps, args.every, args.eval = 2, 1, 2, 1, 8
    output = Output.from_args(args)
    with tempfile.TemporaryDirectory() as tmp:
        root = f"file://{tmp}"
        teacher = train_teacher(args, root)
        runs = [student(args, root, mode, teacher) for mode in args.modes]
    result = {
        "quick": args.quick,
        "task": args.task,
        "target": args.target,
        "teacher": teacher,
        "students": runs,
        "samples_to_target": {r["mode"]: r["samples_to_target"] for r in runs},
        "setup": (
            f"2-core CPU; task {args.task}; teacher tiny Qwen2 hidden {args.teacher_hidden} x 3 layers "
            f"(supervised on correct answers, {teacher['steps']} steps, held-out {teacher['accuracy']:.3f}); "
            f"students tiny Qwen2 hidden {args.student_hidden} x {args.student_layers} layers from the same "
            f"warm-start, {args.steps} steps x "
            f"{runs[0]['samples_per_step']} samples, greedy held-out accuracy on {args.eval} prompts"
        ),
    }
    output.write_json("distill_quick" if args.quick else "distill", result, indent=1)
    if not args.quick:
        rows = ["| student samples | " + " | ".join(r["mode"] for r in runs) + " |", "|---" * (len(runs) + 1) + "|"]
        for points in zip(*(r["curve"] for r in runs), strict=True):
            rows.append(f"| {points[0]['samples']} | " + " | ".join(f"{p['accuracy']:.3f}" for p in points) + " |")
        rows.append(f"| samples to {args.target} | "
                    + " | ".join(str(r["samples_to_target"] or "not reached") for r in runs) + " |")
        output.table("distill", rows, "## On-policy distillation vs RL (`benchmarks/distill.py`, results/distill.json)"
                     "\n\n" + result["setup"])
    print(json.dumps({"teacher_accuracy": teacher["accuracy"], "samples_to_target": result["samples_to_target"]}))


if __name__ == "__main__":
    main()
