"""How much a run's held-out score depends on how many held-out prompts it is scored on.

The main job's pass mark is 0.8 per modality. On n prompts a score p has a binomial standard
error sqrt(p (1 - p) / n): 0.045 at p = 0.85 and n = 64, enough to fail a run whose policy is
above the mark. This re-scores the final checkpoint of finished runs (``pipeline_run.py`` roots
or ``.relax``) on the first 64, 128 and 512 held-out prompts per task of one larger snapshot of
the same suite; the suite's prefixes are stable, so the 64 are the prompts the run was scored
on with ``data.eval_per_task=64``.

    python benchmarks/heldout_size.py /tmp/runs/s0 /tmp/runs/s4 [--update-docs]

Prints one row per run and size, then one JSON object as its last line (also written as heldout_size.json to the
untracked results folder; ``--update-docs``: benchmarks/results/, see output.py): per run and size the
accuracy per modality and per kind of question, and the standard error per modality.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile

from output import Output, add_arguments

from relax.config import load_config
from relax.objstore import absolute_url
from relax.pipeline import evaluate, latest_checkpoint
from relax.services.run_context import RunContext


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run roots whose newest checkpoint to score")
    parser.add_argument("--sizes", default="64,128,512", help="held-out prompts per task, comma-separated")
    parser.add_argument("--preset", default="omni-cpu")
    add_arguments(parser)
    args = parser.parse_args()
    sizes = sorted(int(s) for s in args.sizes.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(args.preset, [f"root={absolute_url(tmp)}", f"data.eval_per_task={sizes[-1]}"])
        snapshot = RunContext(cfg).snapshot_info.id  # the larger snapshot, built once
        results = []
        for root in args.roots:
            checkpoint = latest_checkpoint(absolute_url(root))
            if not checkpoint:
                raise SystemExit(f"{root}: no registered checkpoint under it; is it a finished run's root?")
            for n in sizes:
                report = evaluate(cfg, checkpoint, limit=n)
                by_modality = {k: round(v, 3) for k, v in report.by_modality.items()}
                stderr = {k: round(math.sqrt(v * (1 - v) / n), 3) for k, v in report.by_modality.items()}
                results.append({"root": root, "checkpoint": checkpoint, "per_task": n, "by_modality": by_modality,
                                "stderr": stderr, "by_kind": {k: round(v, 3) for k, v in report.by_kind.items()}})
                print(f"{root}  n={n:<4} " + "  ".join(f"{k} {v:.3f}±{stderr[k]:.3f}" for k, v in by_modality.items()),
                      flush=True)
    result = {"preset": args.preset, "snapshot": snapshot, "sizes": sizes, "runs": results}
    Output.from_args(args).write_json("heldout_size", result, indent=None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
