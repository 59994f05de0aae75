"""Rollout routing replay (R3) on a tiny MoE policy: its cost per RL step, and the routing noise it removes.

The same Qwen3-MoE policy (the built-in ``tiny-qwen2`` as ``model.family=qwen3_moe``: 4 experts,
top-2, every layer sparse) runs the main job's step shape, interleaved with and without R3 in one
run: the native engine samples 16 arithmetic prompts x 8 answers (up to 16 new tokens; with R3 it
records every position's experts), then the actor takes one GRPO step on them (with R3 its
forward replays those experts). Reported: seconds to generate, to train and in all (median of the
repeats) and their ratio with R3 / without; and, on the batch just sampled and before any update,
how far the training forward's log-probs lie from the engine's with and without R3 (the importance
ratio's routing noise) and the share of (token, layer) routes the two forwards disagree on.

    python benchmarks/moe.py [--quick]

Writes moe.json and the moe table to the untracked results folder (``--update-docs``:
benchmarks/results/moe.json and docs/benchmarks.md; see output.py); the last line is one JSON
object with step_overhead (R3 / plain step time) and the log-prob gaps.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch
from output import Output, add_arguments

from relax.config import load_config
from relax.data.suite import generate_suite
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.models.moe_routing import RouteRecorder
from relax.rollout.prompts import encode_prompt
from relax.services.queue_contract import routes_column
from relax.trainers.torch.actor import Actor
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.forward import compute_logprobs
from relax.trainers.torch.trainer import plan_micro_batches


def sample(engine: NativeEngine, prompts: list[list[int]], n: int, new_tokens: int, seed: int) -> RolloutBatch:
    """One batch from the engine (n answers per prompt) with GRPO-like +-1 advantages, routes if recorded."""
    futures = [engine.submit(GenerateRequest(f"b{seed}-{i}", p, SamplingParams(max_new_tokens=new_tokens, n=n,
                                                                               sampling_seed=seed * 1000 + i)))
               for i, p in enumerate(prompts)]
    while engine.step():
        pass
    rows = [(p, c) for p, f in zip(prompts, futures, strict=True) for c in f.result()]
    recorded = rows[0][1].routed_experts is not None
    return RolloutBatch(
        ids=[str(i) for i in range(len(rows))], input_ids=[torch.tensor(p + c.output_ids) for p, c in rows],
        loss_mask=[torch.tensor([0.0] * len(p) + [1.0] * len(c.output_ids)) for p, c in rows],
        old_logprobs=[torch.tensor([0.0] * len(p) + c.logprobs) for p, c in rows],
        advantages=[torch.full((len(p) + len(c.output_ids),), 1.0 if i % 2 else -1.0) for i, (p, c) in enumerate(rows)],
        routed_experts=[torch.tensor(routes_column(c.routed_experts, len(p) + len(c.output_ids), c.rid),
                                     dtype=torch.long) for p, c in rows] if recorded else None,
        policy_versions=[0] * len(rows))


def gap(model: torch.nn.Module, batch: RolloutBatch) -> float:
    """Mean |training forward log-prob - engine log-prob| over the sampled tokens."""
    logprobs = compute_logprobs(model, plan_micro_batches(batch, 4096, "pack"), len(batch))
    diffs = [(lp - old)[m.bool()].abs() for lp, old, m in zip(logprobs, batch.old_logprobs, batch.loss_mask,
                                                              strict=True)]
    return float(torch.cat(diffs).mean())


def disagreement(model: torch.nn.Module, batch: RolloutBatch) -> float:
    """Share of (token, layer) routes where a training forward of each row picks other experts than the engine."""
    recorder = RouteRecorder(model)
    differ = total = 0
    for ids, engine in zip(batch.input_ids, batch.routed_experts, strict=True):
        with torch.no_grad(), recorder.capture() as own:
            model(input_ids=ids[None, :-1])  # the positions the engine fed
        mine, theirs = own[0].long().sort(-1).values, engine[:-1].sort(-1).values
        differ += int((mine != theirs).any(-1).sum())
        total += mine.shape[0] * mine.shape[1]
    return differ / total


def routing_noise(model: torch.nn.Module, batch: RolloutBatch) -> dict[str, float]:
    """The training forward's distance from the engine's log-probs, with and without R3, and the routes it changes."""
    plain = RolloutBatch(ids=batch.ids, input_ids=batch.input_ids, loss_mask=batch.loss_mask,
                         old_logprobs=batch.old_logprobs)
    return {"gap_without_r3": gap(model, plain), "gap_with_r3": gap(model, batch),
            "route_disagreement": disagreement(model, batch)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    repeats, n, new_tokens = (3, 4, 8) if args.quick else (8, 8, 16)
    tok = build_tokenizer("bpe-tiny")
    cfgs = {r3: load_config("tiny-cpu", ["model.family=qwen3_moe", "trainer.warmup_steps=0",
                                         f"algorithm.routing_replay={str(r3).lower()}"]) for r3 in (False, True)}
    base, _ = build_policy(cfgs[True].model, tok, seed=0)
    suite = generate_suite(["arithmetic"], seed=0, train_per_task=16, eval_per_task=1)["train"]
    prompts = [list(encode_prompt(s, [], [], tok, None).input_ids) for s in suite]
    engines, actors = {}, {}
    for r3 in (False, True):
        engines[r3] = NativeEngine(copy.deepcopy(base), tok, max_batch_size=len(prompts) * n, max_seq_len=256,
                                   seed=0, background=False, record_routes=r3)
        actors[r3] = Actor(copy.deepcopy(base), cfgs[r3])
    times = {r3: {"generate": [], "train": [], "step": []} for r3 in (False, True)}
    first = None
    for i in range(repeats + 1):  # round 0 warms up allocator and kernels
        for r3 in (False, True):
            t0 = time.perf_counter()
            batch = sample(engines[r3], prompts, n, new_tokens, seed=i)
            t1 = time.perf_counter()
            first = batch if r3 and first is None else first
            actors[r3].train_step(batch)
            t2 = time.perf_counter()
            if i:
                times[r3]["generate"].append(t1 - t0)
                times[r3]["train"].append(t2 - t1)
                times[r3]["step"].append(t2 - t0)
    noise = {"same_weights": routing_noise(copy.deepcopy(base), first)}
    moved = Actor(copy.deepcopy(base), cfgs[True])
    moved.train_step(first)  # one version later, as a sample trained at max_staleness 1 (routers moved too)
    noise["one_step_later"] = routing_noise(moved.model, first)
    med = {
        ("r3" if r3 else "plain"): {k: statistics.median(v) for k, v in parts.items()} for r3, parts in times.items()
    }
    ratio = {k: med["r3"][k] / med["plain"][k] for k in ("generate", "train", "step")}
    result = {"quick": args.quick, "seconds": med, "ratio_r3_to_plain": ratio, "step_overhead": ratio["step"],
              **noise, "samples": len(first), "tokens": sum(first.lengths),
              "setup": (f"tiny-qwen2 as Qwen3-MoE (4 experts, top-2, {base.config.num_hidden_layers} sparse layers), "
                        f"{len(prompts)} arithmetic prompts x {n} answers, up to {new_tokens} new tokens; one native "
                        f"engine generation and one GRPO actor step (AdamW, packed rows), median of {repeats}, "
                        f"interleaved, 2 CPU cores.")}
    output.write_json("moe", result)
    rows = ["| | generate s | train s | step s |", "|---|---|---|---|"]
    for name in ("plain", "r3"):
        rows.append(f"| {'with R3' if name == 'r3' else 'without R3'} | {med[name]['generate']:.3f} | "
                    f"{med[name]['train']:.3f} | {med[name]['step']:.3f} |")
    rows.append(f"| R3 / without | {ratio['generate']:.3f}x | {ratio['train']:.3f}x | {ratio['step']:.3f}x |")
    rows += ["", "| training forward vs the engine's sample | routes that differ | mean abs log-prob gap without R3 "
             "| with R3 |", "|---|---|---|---|"]
    for key, label in (("same_weights", "same weights (on-policy)"), ("one_step_later", "one update later")):
        x = noise[key]
        rows.append(f"| {label} | {x['route_disagreement']:.1%} | {x['gap_without_r3']:.2e} | "
                    f"{x['gap_with_r3']:.2e} |")
    output.table("moe", rows, "## MoE routing replay (`benchmarks/moe.py`, results/moe.json)\n\n" + result["setup"])
    print(json.dumps({"step_overhead": round(ratio["step"], 4), **noise["one_step_later"]}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
