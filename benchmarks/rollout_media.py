"""Generating one rollout batch of the main job: media prompts prefilled once per prompt vs once
per sample, side by side in one run.

The rollout sends each prompt's n samples as n requests (each its own sampling stream and,
in agent episodes, its own future turns). They share one encoding, so the native engine
prefills them once (``_same_media_prompts``): the vision/audio tower and the prompt run once
per prompt instead of n times. The baseline replaces that grouping with one group per
request, everything else equal (same model, prompts, seeds and outputs).

    python benchmarks/rollout_media.py [--quick]

Batch: 16 prompts of the main job's tasks (shapes, tones, largest; omni-cpu's tiny Omni
thinker) x 8 samples, 8 new tokens, 1 torch thread. Writes rollout_media.json to the untracked
results folder (``--update-docs``: benchmarks/results/; see output.py). Last line: one JSON
object with ``speedup`` and both medians.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from output import Output, add_arguments

import relax.engines.native.engine as native
from relax.config import load_config
from relax.data.suite import generate_suite
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_policy, build_tokenizer
from relax.rollout.prompts import encode_prompt


def one_group_per_request(admitted: list) -> list[list]:
    """The baseline grouping: every request prefills alone."""
    return [[x] for x in admitted]


def batch_prompts(tok, processor, n_prompts: int) -> list:
    suite = generate_suite(["largest", "shapes", "tones"], seed=0, train_per_task=n_prompts, eval_per_task=1,
                           difficulty=1)
    by_task = {t: [s for s in suite["train"] if s.task == t] for t in ("largest", "shapes", "tones")}
    mixed = [by_task[t][i] for i in range(n_prompts) for t in by_task][:n_prompts]  # the main job's mix
    return [encode_prompt(s, [r.data for r in s.images], [r.data for r in s.audios], tok, processor) for s in mixed]


def generate(model, tok, prompts, samples: int, shared: bool) -> tuple[float, list[list[int]]]:
    grouping = native._same_media_prompts
    if not shared:
        native._same_media_prompts = one_group_per_request
    try:
        engine = native.NativeEngine(model, tok, max_batch_size=len(prompts) * samples, background=False)
        futures = [engine.submit(GenerateRequest(f"{i}:{j}", p.input_ids, SamplingParams(max_new_tokens=8,
                                                 sampling_seed=i * samples + j), p.mm_inputs))
                   for i, p in enumerate(prompts) for j in range(samples)]
        t0 = time.perf_counter()
        engine.run_until_idle()
        return time.perf_counter() - t0, [f.result()[0].output_ids for f in futures]
    finally:
        native._same_media_prompts = grouping


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    torch.set_num_threads(1)
    repeats = 2 if args.quick else 7
    cfg = load_config("omni-cpu", [])
    tok = build_tokenizer(cfg.model.tokenizer)
    model, processor = build_policy(cfg.model, tok, seed=0)
    model.eval()
    prompts = batch_prompts(tok, processor, 16)
    times: dict[str, list[float]] = {"per_request": [], "shared": []}
    outputs = {}
    for _ in range(repeats):  # interleaved, so drift on a shared machine hits both alike
        for name in times:
            dt, outputs[name] = generate(model, tok, prompts, 8, shared=name == "shared")
            times[name].append(dt)
    if outputs["shared"] != outputs["per_request"]:
        raise SystemExit("shared prefill changed the sampled tokens: a bug, not a speedup")
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"quick": args.quick, "prompts": len(prompts), "media_prompts": sum(bool(p.mm_inputs) for p in prompts),
              "samples_per_prompt": 8, "repeats": repeats, "seconds": times,
              "median_s": med, "speedup": med["per_request"] / med["shared"]}
    output.write_json("rollout_media", result)
    print(json.dumps({"speedup": round(result["speedup"], 2), "shared_s": round(med["shared"], 4),
                      "per_request_s": round(med["per_request"], 4)}))


if __name__ == "__main__":
    main()
