"""Training throughput with padding-free packing against padded micro-batches.

One batch whose response lengths vary 4:1 (uniform in [L/4, L]) is trained with the same
model, loss and token budget in three layouts, in one run, interleaved: ``pack`` (rows of
concatenated samples with a block-diagonal causal mask), ``pad`` (input order, padded to
the longest sample of each micro-batch; what most trainers do) and ``bucket`` (sorted by
length, then padded). Reported: real (non-pad) training tokens per second for a full
forward + backward + optimizer step, and the share of computed positions that are padding.

    python benchmarks/trainer.py [--quick]

Writes trainer.json and the trainer table to the untracked results folder (``--update-docs``:
benchmarks/results/trainer.json and docs/benchmarks.md; see output.py); the
last line is one JSON object with packing_speedup, padded_waste, packed_waste.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
from output import Output, add_arguments
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.trainers.packing import waste
from relax.trainers.torch.batch import RolloutBatch
from relax.trainers.torch.trainer import TorchTrainer, sft_loss


def make_batch(n: int, longest: int, prompt: int, vocab: int, skewed: bool, seed: int = 0) -> RolloutBatch:
    """Response lengths in [longest/4, longest]: uniform, or log-uniform (``skewed``: most responses
    short, a few long, as RL response lengths usually are)."""
    g = torch.Generator().manual_seed(seed)
    ids, masks = [], []
    for _ in range(n):
        u = float(torch.rand((), generator=g))
        r = round(longest / 4 * 4 ** u) if skewed else round(longest / 4 + u * (longest - longest / 4))
        ids.append(torch.randint(0, vocab, (prompt + r,), generator=g))
        masks.append(torch.cat([torch.zeros(prompt), torch.ones(r)]))
    return RolloutBatch(ids=[str(i) for i in range(n)], input_ids=ids, loss_mask=masks)


def run(layout: str, batch: RolloutBatch, budget: int, cfg: Qwen2Config) -> dict:
    torch.manual_seed(0)
    trainer = TorchTrainer(Qwen2ForCausalLM(cfg), lr=1e-4, micro_batch_tokens=budget, layout=layout)
    mbs = trainer.micro_batches(batch)
    t0 = time.perf_counter()
    trainer.step(batch, sft_loss)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": sum(batch.lengths) / seconds, "waste": waste(mbs),
            "micro_batches": len(mbs)}


def run_backend(backend: str, batch: RolloutBatch, budget: int, cfg: Qwen2Config) -> dict:
    """One packed SFT step of ``backend`` from the same initial weights (megatron: the same model
    converted into megatron-core's GPTModel, relax.trainers.megatron.policy)."""
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(cfg)
    if backend == "megatron":
        from relax.trainers.megatron.policy import megatron_policy

        model = megatron_policy(model)
    trainer = TorchTrainer(model, lr=1e-4, micro_batch_tokens=budget, layout="pack")
    t0 = time.perf_counter()
    trainer.step(batch, sft_loss)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "tokens_per_s": sum(batch.lengths) / seconds}


def compare_backends(batch: RolloutBatch, budget: int, cfg: Qwen2Config, repeats: int) -> dict | None:
    """PyTorch vs Megatron-core backend on one batch, interleaved; None without megatron-core."""
    import importlib.util
    import warnings

    if importlib.util.find_spec("megatron") is None:
        return None
    warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.")
    runs: dict[str, list[dict]] = {"torch": [], "megatron": []}
    for backend in runs:  # warm-up
        run_backend(backend, batch, budget, cfg)
    for _ in range(repeats):
        for backend in runs:
            runs[backend].append(run_backend(backend, batch, budget, cfg))
    return {k: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in v)} for k, v in runs.items()}


def write_backend_table(result: dict, output: Output) -> None:
    b = result["backends"]
    rows = ["| backend | real tokens/s | vs torch |", "|---|---|---|"]
    for name, r in b.items():
        rows.append(f"| {name} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / b['torch']['tokens_per_s']:.2f}x |")
    output.table("trainer-backends", rows,
                 "## Training backends (`benchmarks/trainer.py`, results/trainer.json)\n\n"
                 "The same packed batch and model as the packing table (uniform lengths), one SFT step of the "
                 "PyTorch backend and of `trainer.backend=megatron` (megatron-core's GPTModel, local layer spec, "
                 "one process), interleaved, median. On 2 CPU cores neither is favoured by fused kernels "
                 "(megatron's need CUDA); the ratio shows the adapter's overhead, not GPU speed.")


def write_table(result: dict, output: Output) -> None:
    rows = ["| lengths | layout | real tokens/s | padding share | micro-batches | speed vs pad |",
            "|---|---|---|---|---|---|"]
    for dist, layouts in result["distributions"].items():
        pad = layouts["pad"]["tokens_per_s"]
        for name, r in layouts.items():
            rows.append(f"| {dist} | {name} | {r['tokens_per_s']:,.0f} | {r['waste']:.1%} | {r['micro_batches']} | "
                        f"{r['tokens_per_s'] / pad:.2f}x |")
    output.table(
        "trainer", rows, f"## Trainer packing (`benchmarks/trainer.py`, results/trainer.json)\n\n{result['setup']}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    n, longest, repeats = (32, 256, 1) if args.quick else (64, 256, 3)
    cfg = Qwen2Config(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048)
    budget = 2048
    result = {"quick": args.quick, "distributions": {}}
    for dist in ("uniform", "skewed"):
        batch = make_batch(n, longest, prompt=16, vocab=cfg.vocab_size, skewed=dist == "skewed")
        runs: dict[str, list[dict]] = {"pack": [], "pad": [], "bucket": []}
        run("pack", batch, budget, cfg)  # warm-up (allocator, kernels)
        for _ in range(repeats):
            for layout in runs:
                runs[layout].append(run(layout, batch, budget, cfg))
        result["distributions"][dist] = {
            k: {"tokens_per_s": statistics.median(r["tokens_per_s"] for r in v), "waste": v[0]["waste"],
                "micro_batches": v[0]["micro_batches"]} for k, v in runs.items()}
    backends = compare_backends(make_batch(n, longest, 16, cfg.vocab_size, skewed=False), budget, cfg, repeats)
    if backends is not None:
        result["backends"] = backends
    result["setup"] = (
        f"Tiny Qwen2 (hidden 128, 4 layers, vocab 512), {n} samples of 16 prompt + "
        f"{longest // 4}..{longest} response tokens (uniform, or log-uniform = skewed), token budget "
        f"{budget} per micro-batch, SFT loss, one full optimizer step, median of {repeats}, 2 CPU cores."
    )
    output.write_json("trainer", result)
    write_table(result, output)
    if backends is not None:
        write_backend_table(result, output)
    uni, skew = result["distributions"]["uniform"], result["distributions"]["skewed"]
    speed = lambda d, k: round(d[k]["tokens_per_s"] / d["pad"]["tokens_per_s"], 3)  # noqa: E731
    summary = {
        "packing_speedup": speed(uni, "pack"),
        "packing_speedup_skewed": speed(skew, "pack"),
        "bucket_speedup": speed(uni, "bucket"),
        "bucket_speedup_skewed": speed(skew, "bucket"),
        "padded_waste": round(uni["pad"]["waste"], 3),
        "padded_waste_skewed": round(skew["pad"]["waste"], 3),
        "packed_waste": round(uni["pack"]["waste"], 3),
        "packed_tokens_per_s": round(uni["pack"]["tokens_per_s"]),
    }
    if backends is not None:
        summary["megatron_vs_torch"] = round(
            backends["megatron"]["tokens_per_s"] / backends["torch"]["tokens_per_s"], 3
        )
    print(json.dumps(summary))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
