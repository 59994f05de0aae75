"""One run of the main job's steps outside Flyte, for comparing recipes across seeds.

``relax.pipeline.run`` (what ``relax run`` and the workflow do: snapshot, format warm-start,
RL training, held-out evaluation) with the omni-cpu preset and ``key=value`` overrides, under
its own root so several runs can go side by side:

    python benchmarks/pipeline_run.py /tmp/runs/s3 seed=3 algorithm.kl_coef=0.35

Prints the evaluation table, then one JSON object as its last line: the overrides, minutes for
the whole pipeline (both evaluations included), the actor's median seconds per step (``actor_step_s``),
accuracy per modality and per kind of question, and the confusion of each kind (correct
answer -> the policy's answer -> prompts). The seed tables in docs/history/ come from this, two
runs at a time.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from relax.config import load_config
from relax.pipeline import run
from relax.services.report.metrics import read_metrics


def actor_step_seconds(run_url: str) -> float:
    """Median wall time between the actor's step records after the first quarter of the run (the
    actor sets a disaggregated run's pace; the first steps include start-up and the warm queue)."""
    times = [m["time"] for m in read_metrics(run_url, "actor")]
    times = times[len(times) // 4:]
    gaps = sorted(b - a for a, b in zip(times, times[1:], strict=False))
    return gaps[len(gaps) // 2] if gaps else float("nan")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("root", help="a folder or URL of its own for this run (snapshot, warm start, run)")
    parser.add_argument("overrides", nargs="*", help="key=value config overrides on the omni-cpu preset")
    parser.add_argument("--preset", default="omni-cpu")
    parser.add_argument("--eval-limit", type=int, default=None, help="held-out prompts per task (default: all)")
    args = parser.parse_args()
    root = args.root if "://" in args.root else "file://" + str(Path(args.root).resolve())
    cfg = load_config(args.preset, [f"root={root}", *args.overrides])
    t0 = time.perf_counter()
    result = run(cfg, progress=False, eval_limit=args.eval_limit)
    minutes = (time.perf_counter() - t0) / 60
    summary, report = result.train, result.after
    print(report.table(result.before))
    print(json.dumps({"overrides": args.overrides, "minutes_with_eval": round(minutes, 2),
                      "actor_step_s": round(actor_step_seconds(summary.run_url), 4),
                      "by_modality": {k: round(v, 3) for k, v in report.by_modality.items()},
                      "by_kind": {k: round(v, 3) for k, v in report.by_kind.items()},
                      "confusion": report.confusion}))


if __name__ == "__main__":
    main()
