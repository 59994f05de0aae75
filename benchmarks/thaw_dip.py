"""What the vision tower's thaw does to a run: held-out accuracy around it, and how far each part
of the tower's patch embedding moved.

The omni-cpu preset freezes the vision tower until ``trainer.thaw_encoders_at`` (500) and then
trains it. This scores the checkpoints of finished runs (``pipeline_run.py`` roots or ``.relax``)
just before the thaw and at later steps, and measures the relative change
``|w_step - w_before| / |w_before|`` of the patch embedding's rows: rows 0-2 are the colour stem
(``relax.models.tiny_init.init_colour_stem``, weights 1/392 each), the others random filters.

    python benchmarks/thaw_dip.py /tmp/runs/s0 /tmp/runs/s1 --steps 499,599,699 [--update-docs]

Prints one row per run and step, then one JSON object as its last line (also written as
thaw_dip.json to the untracked results folder; ``--update-docs``: benchmarks/results/, see output.py).
"""

from __future__ import annotations

import argparse
import json

import torch
from output import Output, add_arguments

from relax import objstore
from relax.config import load_config
from relax.objstore import absolute_url
from relax.pipeline import evaluate
from relax.services.roles.actor import checkpoint_name
from relax.services.run_context import RunContext
from relax.trainers.checkpoint.trainer_state import read_state

STEM = "model.visual.patch_embed.proj.weight"


def patch_embedding(url: str) -> torch.Tensor:
    _, state = read_state(url)  # verified and loaded with weights_only=True
    return state["model"][STEM].float()


def relative_change(after: torch.Tensor, before: torch.Tensor) -> float:
    return round(float((after - before).norm() / before.norm()), 4)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("roots", nargs="+", help="run roots with checkpoints at every --steps")
    parser.add_argument("--steps", default="499,599,699", help="RL steps to score; the first is the reference")
    parser.add_argument("--preset", default="omni-cpu")
    add_arguments(parser)
    args = parser.parse_args()
    steps = [int(s) for s in args.steps.split(",")]
    runs = []
    for root in args.roots:
        cfg = load_config(args.preset, [f"root={absolute_url(root)}"])
        run_url = RunContext(cfg).run_url
        urls = [objstore.join(run_url, "checkpoints", checkpoint_name(s)) for s in steps]
        missing = [u for u in urls if not objstore.exists(objstore.join(u, "meta.json"))]
        if missing:
            raise SystemExit(f"{root}: no checkpoint at {missing[0]}; pick --steps the run saved "
                             f"(trainer.checkpoint_every={cfg.trainer.checkpoint_every})")
        weights = [patch_embedding(url) for url in urls]
        before = weights[0]
        rows = []
        for step, url, weight in zip(steps, urls, weights, strict=True):
            report = evaluate(cfg, url)
            row = {"step": step, "by_modality": {k: round(v, 3) for k, v in report.by_modality.items()},
                   "by_kind": {k: round(v, 3) for k, v in report.by_kind.items()},
                   "never_answered": report.never_answered(),
                   "stem_change": relative_change(weight[:3], before[:3]),
                   "filters_change": relative_change(weight[3:], before[3:])}
            rows.append(row)
            kinds = row["by_kind"]
            print(f"{root} step {step}: image {row['by_modality'].get('image', 0):.3f} "
                  f"(count {kinds.get('shapes:count', 0):.3f}, colour {kinds.get('shapes:colour', 0):.3f})  "
                  f"stem moved {row['stem_change']:.3f}, other filters {row['filters_change']:.3f}", flush=True)
        runs.append({"root": root, "steps": rows})
    result = {"preset": args.preset, "steps": steps, "runs": runs}
    Output.from_args(args).write_json("thaw_dip", result, indent=None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
