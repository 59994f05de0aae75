"""Asynchronous vs synchronous RL: wall-clock and reward at max_staleness 0, 1, 2; pipeline efficiency.

Part 1 runs the same seeded GRPO run (tiny-cpu model, arithmetic, same number of trained
samples) in the ``disaggregated`` topology (rollout, advantage and actor as separate
processes, one CPU core's worth of torch threads each) at max_staleness 0, 1 and 2, side by
side, and reports wall-clock time and the reward reached. ``max_new_tokens`` is chosen so
that generating a batch costs about as much as training on it.

Part 2 measures the runtime's own pipelining: a producer and a trainer with controlled
per-step costs (sleeps) run through the real TransferQueue, admission control and
WeightStore exactly as the roles do; efficiency = achieved steps/s divided by the bound
set by the slowest stage, 1 / max(generate, train).

Last line: one JSON object with ``async_speedup`` (staleness-0 time / staleness-1 time) and
``pipeline_efficiency``. ``--quick`` runs fewer steps (under a minute).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import threading
import time

import torch
from output import Output, add_arguments

from relax.config import load_config
from relax.services.driver import train
from relax.transfer.columns import Field
from relax.transfer.consumer import ConsumerGroup, wait_for_capacity
from relax.transfer.queue import TransferQueue
from relax.transfer.weights import WeightStore


def rl_run(root: str, staleness: int, steps: int, new_tokens: int) -> dict:
    cfg = load_config("tiny-cpu", [f"root={root}", f"run_id=s{staleness}", "topology=disaggregated",
                                   "data.tasks=[arithmetic]", f"queue.max_staleness={staleness}",
                                   f"trainer.total_steps={steps}", "trainer.lr=3e-3",
                                   f"rollout.max_new_tokens={new_tokens}", f"trainer.checkpoint_every={steps}"])
    t0 = time.perf_counter()
    result = train(cfg, progress=False)
    wall = time.perf_counter() - t0
    rewards = [m["reward"] for m in sorted(result.metrics("rollout"), key=lambda m: m["batch"])]
    k = max(1, len(rewards) // 5)
    gen = sum(m["time_s"] - m["wait_s"] for m in result.metrics("rollout")) / len(result.metrics("rollout"))
    trn = sum(m["train_s"] for m in result.metrics("actor")) / len(result.metrics("actor"))
    return {"max_staleness": staleness, "steps": result.steps, "wall_s": wall,
            "reward_first": sum(rewards[:k]) / k, "reward_last": sum(rewards[-k:]) / k,
            "generate_s_per_batch": gen, "train_s_per_step": trn,
            "max_staleness_seen": max(m["staleness_max"] for m in result.metrics("actor"))}


def pipeline(root: str, gen_s: float, train_s: float, steps: int, staleness: int, batch: int = 8) -> dict:
    """Producer and trainer threads with sleep costs through the real queue and weight store."""
    q = TransferQueue(root, "pipe", "rollouts", poll_interval_s=0.002, max_poll_interval_s=0.01)
    store = WeightStore(root, "pipe", fsync=False, poll_interval_s=0.002)
    state = {"w": torch.zeros(4)}
    store.publish(0, state)
    producer = q.producer("rollout", [Field("tokens", "int64", (None,))])
    consumer = ConsumerGroup(TransferQueue(root, "pipe", "rollouts", poll_interval_s=0.002, max_poll_interval_s=0.01),
                             "actor_train", ["tokens"], batch_groups=1, max_staleness=staleness)

    def produce():
        for k in range(steps):
            wait_for_capacity(q, "actor_train", batch, staleness, incoming=batch)
            version = store.wait_for(max(0, k - staleness))
            time.sleep(gen_s)
            producer.put([{"id": f"{k}.{i}", "group": f"g{k}", "group_size": batch, "policy_version": version,
                           "tokens": torch.arange(4).numpy()} for i in range(batch)])

    t0 = time.perf_counter()
    thread = threading.Thread(target=produce)
    thread.start()
    for s in range(steps):
        consumer.take(s, current_version=s)
        time.sleep(train_s)
        store.publish(s + 1, state)
    thread.join()
    wall = time.perf_counter() - t0
    bound = 1.0 / max(gen_s, train_s)
    return {"gen_s": gen_s, "train_s": train_s, "max_staleness": staleness, "steps": steps, "wall_s": wall,
            "steps_per_s": steps / wall, "bound_steps_per_s": bound, "efficiency": steps / wall / bound}


def write_table(result: dict, output: Output) -> None:
    rows = ["| max_staleness | wall s | speed vs staleness 0 | reward first 20% | reward last 20% | "
            "gen s/batch | train s/step |", "|---|---|---|---|---|---|---|"]
    base = result["runs"][0]["wall_s"]
    for r in result["runs"]:
        rows.append(f"| {r['max_staleness']} | {r['wall_s']:.1f} | {base / r['wall_s']:.2f}x | {r['reward_first']:.3f} "
                    f"| {r['reward_last']:.3f} | {r['generate_s_per_batch']:.3f} | {r['train_s_per_step']:.3f} |")
    rows += ["", "| pipeline (gen s, train s, staleness) | steps/s | bound | efficiency |", "|---|---|---|---|"]
    for p in result["pipeline"]:
        rows.append(f"| {p['gen_s']}, {p['train_s']}, {p['max_staleness']} | {p['steps_per_s']:.2f} | "
                    f"{p['bound_steps_per_s']:.2f} | {p['efficiency']:.3f} |")
    output.table(
        "async",
        rows,
        f"## Async vs sync (`benchmarks/async_vs_sync.py`, results/async_vs_sync.json)\n\n{result['setup']}",
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--new-tokens", type=int, default=48)
    add_arguments(ap)
    args = ap.parse_args()
    output = Output.from_args(args)
    steps = args.steps or (8 if args.quick else 40)
    with tempfile.TemporaryDirectory() as tmp:
        runs = [rl_run(f"file://{tmp}/rl", s, steps, args.new_tokens) for s in (0, 1, 2)]
        pipe_steps = 20 if args.quick else 60
        pipe = [pipeline(f"file://{tmp}/pipe{i}", g, t, pipe_steps, s)
                for i, (g, t, s) in enumerate([(0.05, 0.05, 1), (0.05, 0.05, 2), (0.03, 0.06, 1), (0.06, 0.03, 1)])]
    result = {"setup": (f"2-core CPU; tiny-cpu preset on arithmetic, disaggregated topology (3 processes), "
                        f"{steps} steps x 128 samples, max_new_tokens {args.new_tokens}; pipeline: sleep costs "
                        f"through the real queue, {pipe_steps} steps"),
              "runs": runs, "pipeline": pipe,
              "async_speedup": runs[0]["wall_s"] / runs[1]["wall_s"],
              "async_speedup_staleness2": runs[0]["wall_s"] / runs[2]["wall_s"],
              "pipeline_efficiency": pipe[0]["efficiency"],
              "pipeline_efficiency_min": min(p["efficiency"] for p in pipe)}
    output.write_json("async_vs_sync_quick" if args.quick else "async_vs_sync", result, indent=1)
    if not args.quick:
        write_table(result, output)
    for r in runs:
        print(f"staleness {r['max_staleness']}: {r['wall_s']:.1f} s, reward {r['reward_first']:.3f} -> "
              f"{r['reward_last']:.3f}, gen {r['generate_s_per_batch']:.3f} s, train {r['train_s_per_step']:.3f} s")
    for p in pipe:
        print(f"pipeline gen {p['gen_s']} train {p['train_s']} staleness {p['max_staleness']}: "
              f"efficiency {p['efficiency']:.3f}")
    print(json.dumps({k: result[k] for k in ("async_speedup", "async_speedup_staleness2", "pipeline_efficiency",
                                             "pipeline_efficiency_min")}))


if __name__ == "__main__":
    main()
