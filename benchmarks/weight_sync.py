"""Weight sync through the WeightStore: full bf16 versions against exact deltas, on real AdamW steps.

A Qwen2.5-0.5B-shaped model (random weights from its config; ``--quick``: a smaller shape, named in
the JSON) takes real AdamW steps (fp32 weights, next-token loss on random tokens) at the RL learning
rates 1e-6 and 1e-5. After every step its bf16 weights (what the engines serve) are published as a
new version into two stores side by side, on a local folder and on a local S3 server (moto, started
here): one with every version full (``full_every=1``), one with deltas (``full_every`` past the run).
An engine-side ``WeightFollower`` brings a bf16 copy of the model to each version from each store.
Reported, in one run:

  changed_fraction   bf16 elements whose bits a step changed, per lr
  delta_bytes_ratio  full version bytes / delta version bytes, per lr
  sync_speedup       (publish + fetch + load) time of full versions / of delta versions, per lr and store
  wire_efficiency    bytes/s of our publish + fetch of a full version (serialise, write, read, digest
                     both sides) / bytes/s of a plain parallel fsspec copy (pipe + cat of the same
                     files' bytes), per store
  encodings          the same deltas' bytes under each encoding weight_delta chooses among, and zlib
  broadcast_gloo     the in-cluster path instead: the version broadcast over a gloo group to an engine process

    python benchmarks/weight_sync.py [--quick]

Writes weight_sync.json and the weight-sync table to the untracked results folder (``--update-docs``:
benchmarks/results/weight_sync.json and docs/benchmarks.md; see output.py), and prints one JSON object
as its last line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import uuid
import zlib
from concurrent.futures import ThreadPoolExecutor

import fsspec
import torch
from bench_data import start_moto  # a sibling script: benchmarks/ is sys.path[0]
from output import Output, add_arguments

from relax import objstore
from relax.transfer import weight_delta, weight_files
from relax.transfer.weight_updates import WeightFollower
from relax.transfer.weights import WeightStore

QWEN05 = {"hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
          "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True}
QUICK = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 32000, "tie_word_embeddings": True}
LRS = (1e-6, 1e-5)
SHARD = 256 << 20


def build(shape: dict) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    return Qwen2ForCausalLM(Qwen2Config(**shape, max_position_embeddings=512)).float()


def bf16(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}


class Engine:
    """An engine's bf16 tensors and its swap (the native engine's, without the model around them)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.tensors = {k: v.clone() for k, v in state.items()}
        self.follower = WeightFollower()

    def load(self, store: WeightStore, version: int) -> str:
        def full(state):
            for k, v in state.items():
                self.tensors[k].copy_(v)

        return self.follower.update(store, version, lambda: self.tensors, lambda write, label: write(), full)


def encodings(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor]) -> dict:
    """Bytes of one step's changes under each encoding, and zlib level 1 over the chosen one."""
    sizes = {"mask": 0, "gaps": 0, "int32": 0, "chosen": 0}
    chosen = []
    for name, t in new.items():
        d = weight_delta.diff(old[name], t)
        if d is None:
            continue
        k, n, s = d.values.numel() if d.kind != "full" else t.numel(), t.numel(), t.element_size()
        sizes["mask"] += (n + 7) // 8 + k * s
        sizes["gaps"] += d.nbytes if d.kind in ("gap16", "gap32") else k * (2 + s)
        sizes["int32"] += k * (4 + s)
        sizes["chosen"] += d.nbytes
        chosen += [d.index.numpy().tobytes(), d.values.view(torch.int16).numpy().tobytes()]
    blob = b"".join(chosen)
    t0 = time.perf_counter()
    packed = len(zlib.compress(blob, 1))
    seconds = time.perf_counter() - t0
    full = sum(t.numel() * t.element_size() for t in new.values())
    return {**{f"{k}_ratio": full / max(1, v) for k, v in sizes.items()}, "zlib_ratio": full / max(1, packed),
            "zlib_mb_per_s": len(blob) / seconds / 1e6}


def wire(url: str, state: dict[str, torch.Tensor], repeats: int = 3) -> dict:
    """Our publish + fetch of one full version against a plain parallel fsspec pipe + cat of its files'
    bytes; the best of ``repeats`` each, taking turns at going first, so a passing hiccup of a shared
    machine drops out. On a local folder every timed pass starts with the page cache's dirty pages
    flushed (os.sync, untimed): otherwise whichever goes second pays for the first one's writeback."""
    local = objstore.local_path(url) is not None
    blobs = None

    def settle() -> None:
        if local:
            os.sync()

    def ours() -> tuple[float, list[bytes]]:
        store = WeightStore(url, f"wire-{uuid.uuid4().hex[:6]}", max_shard_bytes=SHARD, fsync=False)
        settle()
        t0 = time.perf_counter()
        store.publish(0, state)
        got = store.fetch(store.manifest(0))
        seconds = time.perf_counter() - t0
        store.retain([], keep_latest=0)
        return seconds, got

    def plain(blobs: list[bytes]) -> float:
        fs, base = objstore.open_fs(objstore.join(url, f"plain-{uuid.uuid4().hex[:6]}"))
        paths = [f"{base}/f{i}" for i in range(len(blobs))]
        fs.makedirs(base, exist_ok=True)
        settle()
        t0 = time.perf_counter()
        if not local:  # fsspec's async batch: one event loop, every object at once
            fs.pipe(dict(zip(paths, blobs, strict=True)))
            fs.cat(paths)
        else:  # a local filesystem has no async batch: a thread per file, as ours
            with ThreadPoolExecutor(8) as pool:
                list(pool.map(fs.pipe_file, paths, blobs))
                list(pool.map(fs.cat_file, paths))
        seconds = time.perf_counter() - t0
        fs.rm(base, recursive=True)
        return seconds

    times: dict[str, list[float]] = {"ours": [], "plain": []}
    seconds, blobs = ours()  # the files' bytes, which the plain copy moves
    times["ours"].append(seconds)
    times["plain"].append(plain(blobs))
    for i in range(1, repeats):
        if i % 2:
            times["plain"].append(plain(blobs))
            times["ours"].append(ours()[0])
        else:
            times["ours"].append(ours()[0])
            times["plain"].append(plain(blobs))
    nbytes = sum(map(len, blobs))
    ours_rate, plain_rate = 2 * nbytes / min(times["ours"]), 2 * nbytes / min(times["plain"])
    return {"bytes": nbytes, "ours_mb_per_s": ours_rate / 1e6, "plain_mb_per_s": plain_rate / 1e6,
            "wire_efficiency": ours_rate / plain_rate}


def _receive(port: int, specs: list[tuple[list[int], torch.dtype]], bucket: int, done) -> None:
    """The engine's side of a broadcast (a process of its own, as an engine server is)."""
    import torch.distributed as dist

    from relax.engines.weight_broadcast import open_group

    group = open_group("gloo", dist.TCPStore("127.0.0.1", port, 2, is_master=False), 1, 2, "bench", 600.0)
    for at in range(0, len(specs), bucket):
        for shape, dtype in specs[at:at + bucket]:
            dist.broadcast(torch.empty(shape, dtype=dtype), group=group, group_src=0)
    done.put(True)


def broadcast(state: dict[str, torch.Tensor]) -> dict:
    """The in-cluster path (rollout.weight_sync=broadcast): one version over a gloo group to one engine
    process (NCCL between GPUs is the same collective; its speed is the interconnect's)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from relax.engines.weight_broadcast import open_group

    tensors = [state[k] for k in sorted(state)]
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(store.port, [(list(t.shape), t.dtype) for t in tensors], 64, done))
    proc.start()
    group = open_group("gloo", store, 0, 2, "bench", 600.0)
    t0 = time.perf_counter()
    for t in tensors:
        dist.broadcast(t, group=group, group_src=0)
    done.get(timeout=600)
    seconds = time.perf_counter() - t0
    proc.join(timeout=60)
    dist.destroy_process_group(group)
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    return {"bytes": nbytes, "seconds": seconds, "mb_per_s": nbytes / seconds / 1e6}


def sync(store: WeightStore, engine: Engine, version: int, state: dict[str, torch.Tensor]) -> float:
    """Seconds to publish ``state`` as ``version`` and bring ``engine`` to it."""
    t0 = time.perf_counter()
    store.publish(version, state)
    engine.load(store, version)
    return time.perf_counter() - t0


def train(shape: dict, lr: float, steps: int, folder: str) -> list[str]:
    """``steps`` AdamW steps (fp32 weights, next-token loss on random tokens); the bf16 weights before
    and after each, saved to ``folder``. Training first and syncing after keeps the model and AdamW's
    moments (8 GB at 0.5B) out of memory while the syncs run."""
    model = build(shape)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=False)  # no fused temporaries
    g = torch.Generator().manual_seed(1)
    paths = [f"{folder}/lr{lr:g}-v0.pt"]
    torch.save(bf16(model), paths[0])
    for v in range(1, steps + 1):
        ids = torch.randint(0, shape["vocab_size"], (2, 32), generator=g)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print(f"lr {lr:g} step {v}: loss {loss.item():.3f}", file=sys.stderr)
        paths.append(f"{folder}/lr{lr:g}-v{v}.pt")
        torch.save(bf16(model), paths[-1])
    return paths


def run_store(lr: float, paths: list[str], url: str) -> dict:
    """Each saved version synced through a full store and a delta store at ``url``, side by side."""
    run = f"lr{lr:g}-{uuid.uuid4().hex[:6]}"
    steps = len(paths) - 1
    full = WeightStore(url, f"{run}-full", max_shard_bytes=SHARD, fsync=False)
    delta = WeightStore(url, f"{run}-delta", max_shard_bytes=SHARD, fsync=False, full_every=steps + 2)
    state = torch.load(paths[0], mmap=True)
    e_full, e_delta = Engine(state), Engine(state)
    for store, engine in ((full, e_full), (delta, e_delta)):  # version 0, full in both
        store.publish(0, state)
        engine.load(store, 0)
    times = {"full": 0.0, "delta": 0.0}
    changed, total, full_bytes, delta_bytes, enc = 0, 0, 0, 0, None
    for v in range(1, steps + 1):
        state = torch.load(paths[v], mmap=True)
        for k, t in state.items():  # against what the engines hold: the version before
            changed += int((t.view(torch.int16) != e_full.tensors[k].view(torch.int16)).sum())
            total += t.numel()
        enc = encodings(e_full.tensors, state) if enc is None else enc
        ways = [("full", full, e_full), ("delta", delta, e_delta)]
        for way, store, engine in ways if v % 2 else ways[::-1]:  # neither always goes first
            times[way] += sync(store, engine, v, state)
        assert e_delta.follower.last_path == "delta", "the delta store's engine loaded a whole version"
        assert all(torch.equal(e_delta.tensors[k].view(torch.int16), state[k].view(torch.int16))
                   for k in state if state[k].dtype == torch.bfloat16), "a delta did not land on the same bits"
        full_bytes += sum(f["bytes"] for f in full.manifest(v)["files"])
        delta_bytes += sum(f["bytes"] for f in delta.manifest(v)["files"])
        full.retain([], keep_latest=1)  # moto holds every object in memory
        delta.retain([], keep_latest=1)  # (and what the kept delta is rebuilt from)
    full.retain([], keep_latest=0)
    delta.retain([], keep_latest=0)
    return {"changed_fraction": changed / total, "full_bytes": full_bytes, "delta_bytes": delta_bytes,
            "seconds": times, "encodings": enc}


def run_lr(shape: dict, lr: float, steps: int, stores: dict[str, str], folder: str) -> dict:
    paths = train(shape, lr, steps, folder)
    gc.collect()
    by_store = {name: run_store(lr, paths, url) for name, url in stores.items()}
    first = next(iter(by_store.values()))
    return {"lr": lr, "steps": steps, "changed_fraction": first["changed_fraction"],
            "delta_bytes_ratio": first["full_bytes"] / first["delta_bytes"],
            "full_mb_per_version": first["full_bytes"] / steps / 1e6,
            "delta_mb_per_version": first["delta_bytes"] / steps / 1e6,
            "sync_speedup": {name: r["seconds"]["full"] / r["seconds"]["delta"] for name, r in by_store.items()},
            "seconds_per_version": {name: {k: s / steps for k, s in r["seconds"].items()}
                                    for name, r in by_store.items()},
            "encodings": first["encodings"]}


def write_table(result: dict, output: Output) -> None:
    rows = ["| lr | changed | full MB | delta MB | bytes ratio | speedup file | speedup s3 |",
            "|---|---|---|---|---|---|---|"]
    for r in result["lrs"]:
        rows.append(f"| {r['lr']:g} | {r['changed_fraction']:.2%} | {r['full_mb_per_version']:.1f} | "
                    f"{r['delta_mb_per_version']:.1f} | {r['delta_bytes_ratio']:.1f} | "
                    f"{r['sync_speedup']['file']:.1f}x | {r['sync_speedup']['s3']:.1f}x |")
    w = result["wire"]
    rows.append("")
    rows.append(f"Wire efficiency (our publish + fetch of a full version / plain parallel fsspec copy): "
                f"file {w['file']['wire_efficiency']:.2f} ({w['file']['ours_mb_per_s']:.0f} vs "
                f"{w['file']['plain_mb_per_s']:.0f} MB/s), s3 {w['s3']['wire_efficiency']:.2f} "
                f"({w['s3']['ours_mb_per_s']:.0f} vs {w['s3']['plain_mb_per_s']:.0f} MB/s). Model: {result['model']}.")
    g = result["broadcast_gloo"]
    rows.append(f"In-cluster broadcast of the same version over gloo to one engine process: {g['seconds']:.2f} s "
                f"({g['mb_per_s']:.0f} MB/s).")
    output.table("weight_sync", rows, "### Weight sync: full versions vs exact deltas")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smaller model shape and fewer steps")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    shape, steps = (QUICK, 2) if args.quick else (QWEN05, 3)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    moto, _ = start_moto()
    try:
        bucket = f"relax-bench-{uuid.uuid4().hex[:8]}"
        fsspec.filesystem("s3").mkdir(bucket)
        with tempfile.TemporaryDirectory() as tmp:
            stores = {"file": f"file://{tmp}/store", "s3": f"s3://{bucket}"}
            lrs = [run_lr(shape, lr, steps, stores, tmp) for lr in LRS]
            state = bf16(build(shape))
            gc.collect()
            wires = {name: wire(url, state) for name, url in stores.items()}
        gloo = broadcast(state)
    finally:
        moto.terminate()
    n = sum(t.numel() for t in state.values())
    result = {"quick": args.quick, "model": f"{'quick shape' if args.quick else 'Qwen2.5-0.5B shape'} "
                                            f"({n / 1e6:.0f}M parameters, bf16 versions)",
              "shape": shape, "digest": weight_files.DIGEST, "lrs": lrs, "wire": wires, "broadcast_gloo": gloo}
    output.write_json("weight_sync", result)
    write_table(result, output)
    summary = {"model": result["model"], "quick": args.quick,
               **{f"changed_fraction_lr{r['lr']:g}": round(r["changed_fraction"], 4) for r in lrs},
               **{f"delta_bytes_ratio_lr{r['lr']:g}": round(r["delta_bytes_ratio"], 2) for r in lrs},
               **{f"sync_speedup_{s}_lr{r['lr']:g}": round(r["sync_speedup"][s], 2) for r in lrs for s in stores},
               **{f"wire_efficiency_{s}": round(w["wire_efficiency"], 3) for s, w in wires.items()},
               "broadcast_gloo_s": round(gloo["seconds"], 3),
               **{f"full_sync_s_{s}": round(lrs[0]["seconds_per_version"][s]["full"], 3) for s in stores}}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
