"""The actor's step with decoupled PPO's proximal logprobs from a pass of their own, against
taking the first mini-batch's from its own training forward.

The proximal policy is the weights before the step's first update. The actor used to score
the whole batch with them in a gradient-free pass, then run the ``trainer.mini_batches``
updates; the first update's forward runs those same weights, so its detached logprobs are
the first part's proximal ones, and only the later parts need the pass
(``Actor.train_step``). Both variants run here on the main job's batch shape and config
(omni-cpu: 20 prompts x 8 answers over shapes, tones and largest, 4 mini-batches, top-32 KL
to the reference, the vision tower frozen as in its first 500 steps), on two copies of one
model, interleaved in one run. ``tests/relax/trainers/torch/test_actor.py`` checks that
both train identically. Reported: seconds per actor step, median of the repeats, and the
speed-up.

    python benchmarks/proximal.py [--quick]

Writes benchmarks/results/proximal.json and the proximal table in docs/benchmarks.md; the
last line is one JSON object with step_speedup.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from doc_table import update_table  # noqa: E402  (benchmarks/ is sys.path[0])
from prefix import grpo_batch  # noqa: E402

from relax.config_loader import load_config
from relax.models import build_policy, build_tokenizer
from relax.trainers.torch.actor import Actor, Reference

HERE = Path(__file__).resolve().parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out", default=str(HERE / "results" / "proximal.json"))
    args = parser.parse_args()
    repeats = 3 if args.quick else 40
    cfg = load_config("omni-cpu", [])
    tokenizer = build_tokenizer(cfg.model.tokenizer)
    model, processor = build_policy(cfg.model, tokenizer, seed=0)
    batch = grpo_batch(tokenizer, processor, prompts_per_task=2 if args.quick else 7, answers=8)
    reference = Reference(copy.deepcopy(model), layout=cfg.trainer.micro_batch_layout)
    batch.ref_topk_ids, batch.ref_topk_logprobs, batch.ref_logprobs = reference.topk(batch, cfg.algorithm.kl_topk)
    actors = {"pass": Actor(model, cfg), "first": Actor(copy.deepcopy(model), cfg)}
    g = torch.Generator().manual_seed(0)
    times: dict[str, list[float]] = {k: [] for k in actors}
    for i in range(repeats + 1):  # the first round warms up allocator and kernels
        # behaviour two versions stale (as at max_staleness 2) and group-relative advantages of +-1
        behaviour = [(lp - 0.05 * torch.rand(lp.shape, generator=g)) * m
                     for lp, m in zip(actors["first"].logprobs(batch), batch.loss_mask, strict=True)]
        signs = torch.randint(0, 2, (len(batch),), generator=g) * 2.0 - 1
        for name, a in actors.items():
            step = copy.copy(batch)
            step.old_logprobs = behaviour
            step.advantages = [s * m for s, m in zip(signs, batch.loss_mask, strict=True)]
            t0 = time.perf_counter()
            if name == "pass":
                step.prox_logprobs = a.logprobs(step)
            a.train_step(step)
            if i:
                times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"quick": args.quick, "seconds": med, "samples": len(batch), "step_speedup": med["pass"] / med["first"],
              "setup": (f"omni-cpu actor (tiny-omni, {cfg.trainer.mini_batches} mini-batches, top-"
                        f"{cfg.algorithm.kl_topk} KL, decoupled PPO, vision frozen), {len(batch)} samples = "
                        f"{len(batch) // 8} prompts of shapes, tones, largest x 8 answers; one actor step, median of "
                        f"{repeats}, 2 CPU cores.")}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    rows = [f"Setup: {result['setup']}", "", "| proximal logprobs | actor step s | speed |", "|---|---|---|",
            f"| a pass over the whole batch | {med['pass']:.4f} | 1.00x |",
            f"| first part's from its own forward | {med['first']:.4f} | {result['step_speedup']:.2f}x |"]
    update_table("proximal", rows, "## Proximal logprobs from the first update (`benchmarks/proximal.py`, "
                 "results/proximal.json)")
    print(json.dumps({"step_speedup": round(result["step_speedup"], 3),
                      "seconds": {k: round(v, 4) for k, v in med.items()}}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
