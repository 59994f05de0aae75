"""Learning speed of the main job: held-out accuracy per modality over wall-clock time.

Runs the pipeline's steps exactly as the workflow does (snapshot, format warm-start, evaluate
before, train, evaluate) with the ``omni-cpu`` preset at max_staleness 0 and 2, side by side on
the same seed and data, in the disaggregated topology (three role processes), where staleness
lets generation overlap training; the colocated loop is synchronous at any staleness. Every checkpoint is evaluated
afterwards (greedy, held-out
split), so evaluation never slows the timed training; a checkpoint's time is the actor's
clock when it finished that step, from the run's metrics.

Last line: one JSON object with ``minutes_to_target`` (per staleness, per modality: minutes
of training until held-out accuracy first reached ``--target``, null if never) and
``accuracy_after`` / ``accuracy_before`` (per staleness, per modality). ``--quick`` trains a
few steps on a small eval set (under a minute; checks the script, not learning).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from output import Output, add_arguments

from relax.config import load_config
from relax.pipeline import evaluate, train_run, warm_start
from relax.services.report.metrics import read_all_metrics
from relax.services.run_context import RunContext


def learning_run(root: str, staleness: int, steps: int | None, eval_limit: int | None, target: float,
                 extra: list[str], topology: str, preset: str = "omni-cpu") -> dict:
    cfg = load_config(
        preset,
        [
            f"root={root}",
            f"run_id=learn-s{staleness}",
            f"queue.max_staleness={staleness}",
            f"topology={topology}",
            *([f"trainer.total_steps={steps}"] if steps else []),
            *extra,
        ],
    )
    steps = cfg.trainer.total_steps
    sid = RunContext(cfg).snapshot_info.id
    t0 = time.perf_counter()
    init = warm_start(cfg, sid)
    warm_s = time.perf_counter() - t0
    before = evaluate(cfg, init, limit=eval_limit)
    t1 = time.perf_counter()
    summary = train_run(cfg, init_checkpoint=init, progress=False)
    train_s = time.perf_counter() - t1
    actor = read_all_metrics(summary.run_url)["actor"]
    start = min(m["time"] - m["time_s"] for m in actor)
    curve = []
    ctx = RunContext(cfg)
    for m in actor:
        ckpt = f"{ctx.run_url}/checkpoints/step-{m['step']:06d}"
        if (m["step"] + 1) % cfg.trainer.checkpoint_every and m["step"] + 1 != steps:
            continue
        report = evaluate(cfg, ckpt, limit=eval_limit)
        curve.append({"step": m["step"] + 1, "minutes": (m["time"] - start) / 60, **report.by_modality})
    last_kinds = report.by_kind  # of the last checkpoint: which kind of question is behind a modality's mean
    after = curve[-1]
    reached = {mod: next((c["minutes"] for c in curve if c[mod] >= target), None) for mod in before.by_modality}
    return {
        "max_staleness": staleness,
        "topology": topology,
        "steps": steps,
        "tasks": list(cfg.data.tasks),
        "eval_per_task": eval_limit or cfg.data.eval_per_task,
        "samples_per_step": cfg.rollout.prompts_per_step * cfg.rollout.n_samples_per_prompt,
        "warm_start_s": warm_s,
        "train_s": train_s,
        "before": before.by_modality,
        "after": {k: after[k] for k in before.by_modality},
        "per_task_before": before.accuracy,
        "per_kind_after": last_kinds,
        "minutes_to_target": reached,
        "curve": curve,
        "reward_first": summary.reward_first,
        "reward_last": summary.reward_last,
    }


def write_table(result: dict, output: Output, name: str) -> None:
    rows = [f"Setup: {result['setup']}", "",
            "| max_staleness | modality | before | after | minutes to " + f"{result['target']} | train time |",
            "|---|---|---|---|---|---|"]
    for r in result["runs"]:
        for mod in r["before"]:
            mins = r["minutes_to_target"][mod]
            rows.append(f"| {r['max_staleness']} | {mod} | {r['before'][mod]:.3f} | {r['after'][mod]:.3f} | "
                        f"{'not reached' if mins is None else f'{mins:.1f}'} | {r['train_s'] / 60:.1f} min |")
    preset = result["preset"]
    title = ("## Learning speed of the main job (`benchmarks/learning.py`)" if name == "learning"
             else f"## Learning speed of the {preset} preset (`benchmarks/learning.py --preset {preset}`)")
    output.table(name, rows, title)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--preset", default="omni-cpu", help="the preset to train (omni-video-cpu: the four-modality job)")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--target", type=float, default=0.8)
    ap.add_argument("--staleness", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--topology", default="disaggregated",
                    help="disaggregated (default): rollout, advantage and actor as processes, so staleness lets "
                         "generation overlap training; in colocated the loop is synchronous at any staleness")
    ap.add_argument("overrides", nargs="*", help="extra config overrides key=value")
    add_arguments(ap)
    args = ap.parse_args()
    output = Output.from_args(args)
    steps = args.steps or (4 if args.quick else None)  # None: the preset's total_steps
    extra = list(args.overrides) + (["data.train_per_task=16", "data.eval_per_task=4", "trainer.sft_steps=2",
                                     "trainer.checkpoint_every=2"] if args.quick else [])
    with tempfile.TemporaryDirectory() as tmp:
        runs = [learning_run(f"file://{tmp}/s{s}", s, steps, 4 if args.quick else None, args.target, extra,
                             args.topology, args.preset) for s in args.staleness]
    tasks = " + ".join(runs[0]["tasks"])
    result = {
        "preset": args.preset,
        "setup": f"2-core CPU; {args.preset} preset (tiny-omni, {tasks}), {runs[0]['steps']} steps "
        f"x {runs[0]['samples_per_step']} samples, {args.topology}; held-out greedy accuracy per modality "
        f"({runs[0]['eval_per_task']} prompts per task)" + (f"; {extra}" if extra else ""),
        "target": args.target,
        "runs": runs,
        "minutes_to_target": {f"staleness{r['max_staleness']}": r["minutes_to_target"] for r in runs},
        "accuracy_after": {f"staleness{r['max_staleness']}": r["after"] for r in runs},
        "accuracy_before": {f"staleness{r['max_staleness']}": r["before"] for r in runs},
    }
    name = "learning" if args.preset == "omni-cpu" else f"learning_{args.preset.replace('-', '_')}"
    output.write_json(f"{name}_quick" if args.quick else name, result, indent=1)
    if not args.quick:
        write_table(result, output, name)
    for r in runs:
        print(f"staleness {r['max_staleness']}: train {r['train_s']:.0f} s; before {r['before']} after {r['after']}; "
              f"minutes to {args.target}: {r['minutes_to_target']}")
    print(json.dumps({k: result[k] for k in ("minutes_to_target", "accuracy_after", "accuracy_before")}))


if __name__ == "__main__":
    main()
