"""Shared-prefix training against full rows on the main job's batch shape.

The omni preset's batch: prompt groups of 8 answers each over the image (shapes), audio
(tones) and text (largest) tasks, prompts of ~50 tokens (image and audio placeholders
included) and answers of 3-5 tokens. The same model and batch run one optimizer step
(policy-gradient loss, forward + backward + AdamW) and one gradient-free reference pass in
two layouts, interleaved in one run: ``bucket`` (full rows in length buckets: what the
omni model trained on before) and ``prefix`` (each prompt and its media once, answers
through its KV cache). Reported: seconds per step and per reference pass, median of the
repeats, and the speed-up.

    python benchmarks/prefix.py [--quick]

Writes prefix.json and the prefix table to the untracked results folder (``--update-docs``:
benchmarks/results/prefix.json and docs/benchmarks.md; see output.py); the last
line is one JSON object with train_speedup and reference_speedup.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time

import torch
from output import Output, add_arguments

from relax.config import ModelConfig
from relax.data.suite import TASKS, generate_suite
from relax.models import build_policy, build_tokenizer, prepare_inputs
from relax.trainers.torch.actor import Reference
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.trainer import TorchTrainer, sft_loss


def grpo_batch(tokenizer, processor, prompts_per_task: int, answers: int) -> RolloutBatch:
    """``answers`` oracle-format answers (random labels) per prompt, prompts from the omni tasks."""
    g = torch.Generator().manual_seed(0)
    ids, masks, media = [], [], []
    suite = generate_suite(["shapes", "tones", "largest"], seed=0, train_per_task=prompts_per_task,
                           eval_per_task=1)["train"]
    for s in suite:
        kw = prepare_inputs(s, [r.data for r in s.images], [r.data for r in s.audios], tokenizer, processor)
        extra = {k: v for k, v in kw.items() if k not in ("input_ids", "attention_mask")} or None
        space = TASKS[s.task].answer_space(1)
        for _ in range(answers):
            answer = space[int(torch.randint(len(space), (1,), generator=g))]
            text = TASKS[s.task].oracle_response(dataclasses.replace(s, answer=answer))
            response = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"])
            ids.append(torch.cat([kw["input_ids"][0], response]))
            masks.append(torch.cat([torch.zeros(kw["input_ids"].shape[1]), torch.ones(len(response))]))
            media.append(extra)
    return RolloutBatch(ids=[str(i) for i in range(len(ids))], input_ids=ids, loss_mask=masks, media=media)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    repeats = 3 if args.quick else 10
    tokenizer = build_tokenizer("bpe-tiny")
    model_cfg = ModelConfig(name_or_path="tiny-omni", family="qwen2_5_omni")
    batch = grpo_batch(tokenizer, build_policy(model_cfg, tokenizer, seed=0)[1], prompts_per_task=2, answers=8)
    layouts = ("bucket", "prefix")
    trainers, references = {}, {}
    for layout in layouts:
        model, _ = build_policy(model_cfg, tokenizer, seed=0)
        trainers[layout] = TorchTrainer(model, lr=1e-4, layout=layout)
        references[layout] = Reference(build_policy(model_cfg, tokenizer, seed=0)[0], layout=layout)
    times: dict[str, dict[str, list[float]]] = {k: {"train": [], "reference": []} for k in layouts}
    for i in range(repeats + 1):  # the first round warms up allocator and kernels
        for layout in layouts:
            t0 = time.perf_counter()
            trainers[layout].step(batch, sft_loss)
            t1 = time.perf_counter()
            references[layout].logprobs(batch)
            t2 = time.perf_counter()
            if i:
                times[layout]["train"].append(t1 - t0)
                times[layout]["reference"].append(t2 - t1)
    med = {k: {part: statistics.median(v) for part, v in parts.items()} for k, parts in times.items()}
    prompt_tokens = sum(int((m == 0).sum()) for m in batch.loss_mask)
    result = {"quick": args.quick, "seconds": med, "samples": len(batch), "tokens": sum(batch.lengths),
              "prompt_share": prompt_tokens / sum(batch.lengths),
              "train_speedup": med["bucket"]["train"] / med["prefix"]["train"],
              "reference_speedup": med["bucket"]["reference"] / med["prefix"]["reference"],
              "setup": (f"tiny-omni (Qwen2.5-Omni thinker classes), {len(batch)} samples = 6 prompts (2 each of "
                        f"shapes, tones, largest) x 8 answers, {sum(batch.lengths)} tokens of which "
                        f"{prompt_tokens / sum(batch.lengths):.0%} prompt; one AdamW step (forward + backward) "
                        f"and one no-grad reference pass, median of {repeats}, 2 CPU cores.")}
    output.write_json("prefix", result)
    rows = ["| layout | train step s | reference pass s | train speed | reference speed |", "|---|---|---|---|---|"]
    for layout in layouts:
        rows.append(f"| {layout} | {med[layout]['train']:.4f} | {med[layout]['reference']:.4f} | "
                    f"{med['bucket']['train'] / med[layout]['train']:.2f}x | "
                    f"{med['bucket']['reference'] / med[layout]['reference']:.2f}x |")
    output.table("prefix", rows, "## Shared-prefix training (`benchmarks/prefix.py`, results/prefix.json)\n\n"
                 + result["setup"])
    print(json.dumps({"train_speedup": round(result["train_speedup"], 3),
                      "reference_speedup": round(result["reference_speedup"], 3),
                      "prompt_share": round(result["prompt_share"], 3)}))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
