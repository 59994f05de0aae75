"""megatron-core's DistributedOptimizer against AdamW on every rank, in the Megatron actor at data parallel 2.

Two gloo ranks (this script started once per rank) train the same Qwen2 (random weights from a config) on
the same batch with ``trainer.distributed_optimizer`` off and on, interleaved in one run: the optimizer
state each rank holds (AdamW's two moments: whole on every rank, or its slice), seconds per training step
(forward, backward, gradient sync, optimizer; median of the repeats) and seconds to gather the by-name
checkpoint state. Reported as ratios distributed / AdamW.

    python benchmarks/dist_optim.py [--quick]

Writes dist_optim.json and the dist-optim table to the untracked results folder (``--update-docs``:
benchmarks/results/dist_optim.json and docs/benchmarks.md; see output.py); the last line is one JSON
object with state_ratio and step_ratio.
"""

from __future__ import annotations

import copy
import json
import statistics
import time
from pathlib import Path

from output import Output
from two_ranks import parse_and_launch

OPTIMIZERS = {"AdamW": False, "DistributedAdam": True}


def state_bytes(optimizer) -> int:
    """Bytes of optimizer state (moments and counts) this rank holds."""
    import torch

    parts = getattr(optimizer, "_parts", None)
    states = [st for part in parts for st in part.optimizer.state.values()] if parts else optimizer.state.values()
    return sum(v.numel() * v.element_size() for st in states for v in st.values() if torch.is_tensor(v))


def rank_main(rank: int, port: int, quick: bool, out: str) -> None:
    """One rank: both optimizers, interleaved; rank 0 writes the medians to ``out``."""
    import warnings

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on two cores
    from trainer import make_batch

    from relax.trainers.checkpoint.optim_state import optimizer_state
    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.trainer import TorchTrainer, sft_loss

    hidden, layers, vocab = (128, 2, 512) if quick else (256, 4, 2048)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg)
    init_cpu_distributed(rank, 2, port)
    full = make_batch(32, 128, prompt=16, vocab=vocab, skewed=False)
    share = full.select(range(rank, len(full), 2))  # each data-parallel rank trains half of the batch
    trainers = {name: TorchTrainer(megatron_policy(copy.deepcopy(hf), distributed_optimizer=on), lr=1e-4,
                                   micro_batch_tokens=1024) for name, on in OPTIMIZERS.items()}
    runs: dict[str, dict[str, list[float]]] = {name: {"step": [], "gather": []} for name in trainers}
    for trainer in trainers.values():  # warm-up: every state allocated
        trainer.step(share, sft_loss)
    for _ in range(2 if quick else 5):
        for name, trainer in trainers.items():
            torch.distributed.barrier()
            t0 = time.perf_counter()
            trainer.step(share, sft_loss)
            runs[name]["step"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            optimizer_state(trainer.model, trainer.optimizer)
            runs[name]["gather"].append(time.perf_counter() - t0)
    result = {name: {"state_bytes": state_bytes(trainers[name].optimizer),
                     "step_s": statistics.median(r["step"]), "gather_s": statistics.median(r["gather"])}
              for name, r in runs.items()}
    result["params"] = sum(p.numel() for p in hf.parameters())
    result["tokens_per_rank"] = sum(share.lengths)
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    shutdown_distributed()


def main() -> None:
    launched = parse_and_launch(__file__, __doc__, rank_main)
    if launched is None:  # this process was one of the ranks
        return
    args, measured = launched
    adamw, dist = measured["AdamW"], measured["DistributedAdam"]
    result = {"quick": args.quick, **measured,
              "state_ratio": dist["state_bytes"] / adamw["state_bytes"], "step_ratio": dist["step_s"] / adamw["step_s"],
              "gather_ratio": dist["gather_s"] / adamw["gather_s"],
              "setup": f"Qwen2 of {measured['params'] / 1e6:.1f}M parameters (random, from a config), 2 gloo ranks "
                       f"on 2 CPU cores (data parallel 2), {measured['tokens_per_rank']} tokens per rank per step, "
                       f"one packed SFT step; medians of the interleaved repeats"}
    output = Output.from_args(args)
    output.write_json("dist_optim", result)
    rows = ["| optimizer | optimizer state per rank | step | by-name state gather |", "|---|---|---|---|"]
    for name in OPTIMIZERS:
        r = measured[name]
        rows.append(f"| {name} | {r['state_bytes'] / 2**20:.1f} MiB | {r['step_s'] * 1e3:.0f} ms | "
                    f"{r['gather_s'] * 1e3:.0f} ms |")
    rows.append(f"| distributed / AdamW | {result['state_ratio']:.2f}x | {result['step_ratio']:.2f}x | "
                f"{result['gather_ratio']:.2f}x |")
    output.table("dist-optim", rows, "## Distributed optimizer (`benchmarks/dist_optim.py`, results/dist_optim.json)"
                 f"\n\n{result['setup']}.")
    print(json.dumps({k: result[k] for k in ("state_ratio", "step_ratio", "gather_ratio")}))


if __name__ == "__main__":
    main()
