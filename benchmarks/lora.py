"""LoRA weight sync against full weight sync, at a Qwen2.5-0.5B-shaped model (random weights from a config).

One run, on the local object store (a temporary folder), interleaved repeats of two ways to get a new
policy version from the trainer into a native engine:

* full: ``WeightStore.publish`` of the whole state dict, then the engine's load of that version
  (read, sha256, ``engine.update_weights``);
* adapter: ``publish_adapter`` of a rank-16 adapter on every attention and MLP projection (the
  ``model.lora`` default), then the engine's load of it (read, sha256, merge onto the kept base,
  ``relax.engines.adapter_load``), after the base version was loaded once.

Reported: ``adapter_sync_speedup`` = median (publish + load) full / adapter, ``adapter_bytes_ratio`` =
bytes of a full version / an adapter version, ``optimizer_memory_ratio`` = AdamW state bytes full / LoRA
(LoRA's measured after a real step; the full model's counted as AdamW allocates it, two moments per
trainable parameter plus a step scalar, the count that equals LoRA's measurement, since a real full
AdamW step at this size needs ~8 GB), and ``unmerged_forward_slowdown`` = a forward through PEFT's
unmerged adapters / through the merged weights (why the engine merges). ``peak_rss_gb``: the process's peak
memory; it holds two copies of the weights (the policy's base and the engine's) and one full version in flight,
which at 24 layers peaked at 12.5 GB.

    python benchmarks/lora.py [--quick]

``--quick``: 2 decoder layers instead of 24 (the vocabulary and widths stay 0.5B's). Writes lora.json
and the lora table to the untracked results folder (``--update-docs``: benchmarks/results/ and
docs/benchmarks.md; see output.py); the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import resource
import statistics
import tempfile
import time

import torch
from output import Output, add_arguments
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.config import load_config
from relax.engines.adapter_load import load_into
from relax.models import build_tokenizer
from relax.models.lora import adapter_info, adapter_state, apply_lora, base_state
from relax.rollout.engine_pool import LocalEngines
from relax.trainers.torch.optim import build_optimizer
from relax.transfer.adapter_versions import load_version, publish_adapter
from relax.transfer.weights import WeightStore

SHAPE = dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
             num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True)


def version_bytes(store: WeightStore, version: int) -> int:
    return sum(f["bytes"] for f in store.manifest(version)["files"])


def adamw_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t))


def adamw_bytes_of(params: list[torch.nn.Parameter]) -> int:
    """What AdamW allocates for ``params``: exp_avg and exp_avg_sq like each, and a float32 step scalar."""
    return sum(2 * p.numel() * p.element_size() + 4 for p in params)


def forward_s(models: list[torch.nn.Module], ids: torch.Tensor, repeats: int) -> list[float]:
    """Median forward seconds of each model, timed in turn within each repeat (a one-time warm-up
    each first), so that a shared CPU's load falls on all of them alike."""
    times: list[list[float]] = [[] for _ in models]
    with torch.no_grad():
        for model in models:
            model(input_ids=ids, use_cache=False)
        for _ in range(repeats):
            for model, t in zip(models, times, strict=True):
                t0 = time.perf_counter()
                model(input_ids=ids, use_cache=False)
                t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main() -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 decoder layers, fewer repeats")
    parser.add_argument("--repeats", type=int, default=None)
    add_arguments(parser)
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 5)
    layers = 2 if args.quick else SHAPE["num_hidden_layers"]
    torch.manual_seed(0)
    base = Qwen2ForCausalLM(Qwen2Config(**{**SHAPE, "num_hidden_layers": layers})).eval()
    full_state = adamw_bytes_of(list(base.parameters()))
    # two copies of the weights, no more: the engine's (it merges into them in place) and the policy's,
    # which wraps the base itself; the full version is published from the policy's base tensors
    engine_model = copy.deepcopy(base)
    cfg = load_config(None, ["model.lora.rank=16", "model.lora.alpha=32"])
    torch.manual_seed(1)
    policy = apply_lora(base, cfg.model)
    del base
    info = adapter_info(cfg.model)

    # optimizer state: a real AdamW step over the adapter
    optimizer, _ = build_optimizer(policy, 1e-4, 0.0, 0, 1)
    trainable = [p for p in policy.parameters() if p.requires_grad]
    for p in trainable:
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    lora_state = adamw_state_bytes(optimizer)
    assert lora_state == adamw_bytes_of(trainable), (lora_state, adamw_bytes_of(trainable))
    del optimizer
    for p in trainable:
        p.grad = None

    tok = build_tokenizer("bpe-tiny")
    full_s, adapter_s, full_bytes, adapter_bytes = [], [], 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        store = WeightStore(tmp, "bench", fsync=False)
        pool = LocalEngines(engine_model, tok, max_batch_size=4, max_seq_len=64, seed=0)
        publish_adapter(store, 0, {**base_state(policy), **adapter_state(policy)}, info)
        pool.load_weights(store, 0)  # the engine keeps its base from here on
        version = 1
        for r in range(repeats):
            with torch.no_grad():  # a new adapter each time, as after a training step
                for p in trainable:
                    p.add_(1e-3 * (r + 1))
            t0 = time.perf_counter()
            publish_adapter(store, version, adapter_state(policy), info)
            load_into(pool.engine, load_version(store, version), str(version))
            adapter_s.append(time.perf_counter() - t0)
            adapter_bytes = version_bytes(store, version)
            store.retain([0], keep_latest=1)
            version += 1

            full = base_state(policy)  # the base's own tensors, as a trainer's state_dict would be (no copy)
            t0 = time.perf_counter()
            store.publish(version, full, {})
            load_into(pool.engine, load_version(store, version), str(version))
            full_s.append(time.perf_counter() - t0)
            full_bytes = version_bytes(store, version)
            del full
            store.retain([0], keep_latest=1)
            version += 1
            pool.load_weights(store, 0)  # back onto the base for the next adapter
        pool.close()
    del pool, engine_model  # the engine's weights, fused copies and kept base, before the merged copy below
    gc.collect()

    ids = torch.randint(0, 1000, (8, 32))
    merged = copy.deepcopy(policy).merge_and_unload().eval()
    unmerged, merged_s = forward_s([policy.eval(), merged], ids, repeats)
    result = {
        "model": f"Qwen2.5-0.5B shape (random), {layers} layers", "lora_rank": 16, "repeats": repeats,
        "full_sync_s": statistics.median(full_s), "adapter_sync_s": statistics.median(adapter_s),
        "adapter_sync_speedup": statistics.median(full_s) / statistics.median(adapter_s),
        "full_version_bytes": full_bytes, "adapter_version_bytes": adapter_bytes,
        "adapter_bytes_ratio": full_bytes / adapter_bytes,
        "full_adamw_state_bytes": full_state, "lora_adamw_state_bytes": lora_state,
        "optimizer_memory_ratio": full_state / lora_state,
        "merged_forward_s": merged_s, "unmerged_forward_s": unmerged, "unmerged_forward_slowdown": unmerged / merged_s,
        "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,  # Linux: KiB
    }
    out = Output.from_args(args)
    out.write_json("lora", result)
    out.table("lora", [
        "| measure (Qwen2.5-0.5B shape, random; " + f"{layers} layers, rank 16, local store) | full | LoRA | ratio |",
        "|---|---|---|---|",
        f"| publish + native engine load, median s | {result['full_sync_s']:.3f} | {result['adapter_sync_s']:.3f} | "
        f"{result['adapter_sync_speedup']:.1f}x |",
        f"| version bytes | {full_bytes:,} | {adapter_bytes:,} | {result['adapter_bytes_ratio']:.0f}x |",
        f"| AdamW state bytes | {full_state:,} | {lora_state:,} | {result['optimizer_memory_ratio']:.0f}x |",
        f"| forward (8 x 32 tokens), merged vs PEFT unmerged, median s | {merged_s:.3f} | {unmerged:.3f} | "
        f"{result['unmerged_forward_slowdown']:.2f}x |",
    ], "## LoRA weight sync (`benchmarks/lora.py`)")
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
