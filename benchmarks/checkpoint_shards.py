"""Sharded checkpoints (``trainer.checkpoint_format=sharded``) against gathered ones, Megatron actor at tp=2.

Two gloo ranks (this script started once per rank) hold a tensor-parallel Qwen2 (random weights from a
config) after one training step, and write and resume its checkpoint both ways, interleaved in one run:
gathered (every rank gathers the weights and AdamW moments by Hugging Face name, rank 0 writes one
file) and sharded (each rank writes its own part; relax.trainers.checkpoint.sharded). Measured: seconds until
every rank is done writing, bytes the busiest rank writes, the tensor bytes rank 0 holds for it, seconds
to resume at the same layout (medians of the repeats), and, for the sharded one, seconds to consolidate it
(what resuming at another layout or on the PyTorch backend reads). Reported as ratios sharded / gathered.

    python benchmarks/checkpoint_shards.py [--quick]

Writes checkpoint_shards.json and the checkpoint-shards table to the untracked results folder
(``--update-docs``: benchmarks/results/ and docs/benchmarks.md; see output.py); the last line is one
JSON object with the ratios.
"""

from __future__ import annotations

import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

from output import Output
from two_ranks import parse_and_launch

FORMATS = ("gathered", "sharded")


def tensor_bytes(obj) -> int:
    """Bytes of the tensors in a nested state."""
    import torch

    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(tensor_bytes(v) for v in obj.values())
    if isinstance(obj, list | tuple):
        return sum(tensor_bytes(v) for v in obj)
    return 0


def rank_main(rank: int, port: int, quick: bool, out: str) -> None:
    """One rank: both formats, interleaved; rank 0 writes the medians to ``out``."""
    import warnings

    import torch
    import torch.distributed as dist
    from transformers import Qwen2Config, Qwen2ForCausalLM

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # two ranks on two cores
    from trainer import make_batch

    from relax.trainers.checkpoint.files import read_meta
    from relax.trainers.checkpoint.trainer_state import (
        load_checkpoint,
        read_state,
        save_sharded_checkpoint,
        trainer_state,
        write_checkpoint,
    )
    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.trainer import TorchTrainer, sft_loss

    hidden, layers, vocab = (128, 2, 512) if quick else (512, 4, 8192)
    cfg = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024)
    torch.manual_seed(0)
    hf = Qwen2ForCausalLM(cfg)
    init_cpu_distributed(rank, 2, port, tp=2)
    trainer = TorchTrainer(megatron_policy(hf), lr=1e-4, micro_batch_tokens=1024)
    trainer.step(make_batch(8, 64, prompt=16, vocab=vocab, skewed=False), sft_loss)  # the moments exist
    model, opt, sched = trainer.model, trainer.optimizer, trainer.scheduler
    root = Path(tempfile.mkdtemp(prefix=f"ckpt-bench-{rank}-")) if rank == 0 else None
    box = [str(root)]
    dist.broadcast_object_list(box, src=0)  # one folder for both ranks (one machine)
    root = Path(box[0])

    def save(fmt: str, url: str) -> int:
        """Write a checkpoint; the tensor bytes rank 0 held for it."""
        if fmt == "gathered":
            state = trainer_state(model, opt, sched)
            if rank == 0:
                write_checkpoint(url, state, {"steps_done": 1})
            return tensor_bytes(state)
        save_sharded_checkpoint(url, model, opt, sched, {"steps_done": 1})
        return tensor_bytes(torch.load(Path(url) / "shards" / "tp0-pp0-ep0.pt", weights_only=True))

    runs = {fmt: {"write": [], "resume": []} for fmt in FORMATS}
    held: dict[str, int] = {}
    for i in range(2 if quick else 5):
        for fmt in FORMATS:
            url = str(root / f"{fmt}-{i}")
            dist.barrier()
            t0 = time.perf_counter()
            held[fmt] = save(fmt, url)
            dist.barrier()
            runs[fmt]["write"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            load_checkpoint(url, model, opt, sched)
            dist.barrier()
            runs[fmt]["resume"].append(time.perf_counter() - t0)
    if rank == 0:
        last = [str(root / f"{fmt}-{(2 if quick else 5) - 1}") for fmt in FORMATS]
        t0 = time.perf_counter()
        read_state(last[1])
        consolidate_s = time.perf_counter() - t0
        parts = read_meta(last[1])["shards"]
        result = {fmt: {"write_s": statistics.median(runs[fmt]["write"]),
                        "resume_s": statistics.median(runs[fmt]["resume"]), "held_bytes": held[fmt]}
                  for fmt in FORMATS}
        result["gathered"]["busiest_rank_bytes"] = read_meta(last[0])["bytes"]
        result["sharded"]["busiest_rank_bytes"] = max(p["bytes"] for p in parts) + read_meta(last[1])["bytes"]
        result["sharded"]["consolidate_s"] = consolidate_s
        result["params"] = sum(p.numel() for p in hf.parameters())
        Path(out).write_text(json.dumps(result))
    dist.barrier()
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)
    shutdown_distributed()


def main() -> None:
    launched = parse_and_launch(__file__, __doc__, rank_main)
    if launched is None:  # this process was one of the ranks
        return
    args, m = launched
    g, s = m["gathered"], m["sharded"]
    result = {
        "quick": args.quick,
        **m,
        "write_ratio": s["write_s"] / g["write_s"],
        "resume_ratio": s["resume_s"] / g["resume_s"],
        "bytes_ratio": s["busiest_rank_bytes"] / g["busiest_rank_bytes"],
        "held_ratio": s["held_bytes"] / g["held_bytes"],
        "setup": f"Qwen2 of {m['params'] / 1e6:.1f}M parameters (random, from a config) after one step, 2 gloo "
        f"ranks on 2 CPU cores (tensor parallel 2), float32 weights and AdamW moments, a local "
        f"folder; medians of the interleaved repeats",
    }
    output = Output.from_args(args)
    output.write_json("checkpoint_shards", result)
    rows = ["| format | write (every rank done) | bytes the busiest rank writes | tensor bytes rank 0 holds "
            "| resume, same layout |", "|---|---|---|---|---|"]
    for fmt in FORMATS:
        r = m[fmt]
        rows.append(f"| {fmt} | {r['write_s'] * 1e3:.0f} ms | {r['busiest_rank_bytes'] / 2**20:.1f} MiB | "
                    f"{r['held_bytes'] / 2**20:.1f} MiB | {r['resume_s'] * 1e3:.0f} ms |")
    rows.append(f"| sharded / gathered | {result['write_ratio']:.2f}x | {result['bytes_ratio']:.2f}x | "
                f"{result['held_ratio']:.2f}x | {result['resume_ratio']:.2f}x |")
    output.table("checkpoint-shards", rows, "## Sharded checkpoints (`benchmarks/checkpoint_shards.py`, "
                 f"results/checkpoint_shards.json)\n\n{result['setup']}. Consolidating the sharded checkpoint "
                 f"(resume at another layout or backend): {s['consolidate_s'] * 1e3:.0f} ms.")
    print(json.dumps({k: result[k] for k in ("write_ratio", "bytes_ratio", "held_ratio", "resume_ratio")}))


if __name__ == "__main__":
    main()
