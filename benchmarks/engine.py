"""Native engine throughput against Hugging Face ``generate()``, and HTTP latency under load.

Same tiny Qwen2 (built from a config, seed 0), same prompts, same number of new tokens
(EOS ignored so every sequence runs to the end), sampling at temperature 1, batch sizes
1, 8, 32, 64, in one run, for two models: ``main``, the decoder the CPU presets build
(``relax.models.builders.tiny_config`` of the default ModelConfig: hidden 64, 2 layers, the
512-token bpe-tiny vocabulary; what the engine serves in ``make run`` and the tests), and
``3m``, a 3.4M-parameter one (hidden 256, 4 layers, vocab 2048) whose decode steps are bound
by matmul compute on 2 cores. Tokens/s counts generated tokens over wall time. Then the
native engine is served over HTTP (``relax.engines.server``, a real uvicorn subprocess)
and 64 clients send concurrent /generate requests: p50/p95 latency.

    python benchmarks/engine.py [--quick]

Writes engine.json and the engine table to the untracked results folder (``--update-docs``:
benchmarks/results/engine.json and docs/benchmarks.md; see output.py); the
last line is one JSON object with speedup_vs_hf_b32, tokens_per_s_b32, p95_latency_ms (the
``main`` model) and the same figures of the ``3m`` model with a ``_3m`` suffix.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import torch
from output import Output, add_arguments
from transformers import Qwen2Config, Qwen2ForCausalLM

from relax.config import ModelConfig
from relax.engines.native.engine import NativeEngine
from relax.engines.types import GenerateRequest, SamplingParams
from relax.models import build_tokenizer
from relax.models.builders import tiny_config


def main_config() -> Qwen2Config:
    """The text decoder the CPU presets build (tiny-cpu's model, omni-cpu's decoder), tied LM head included."""
    return tiny_config(ModelConfig(), build_tokenizer(ModelConfig().tokenizer))


MODELS = {
    "main": main_config,
    "3m": lambda: Qwen2Config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512),
}


def build(name: str) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    return Qwen2ForCausalLM(MODELS[name]()).eval()


def prompts(batch: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(16, 33, (1,), generator=g)),),
                          generator=g).tolist() for _ in range(batch)]


def lengths_for(batch: int, new: int, varied: bool, seed: int = 0) -> list[int]:
    """New tokens per request: all ``new``, or (``varied``) uniform in [new/4, new], as responses
    that end at different points do (modelled here by each request's max_new_tokens)."""
    if not varied:
        return [new] * batch
    g = torch.Generator().manual_seed(seed)
    return [int(torch.randint(new // 4, new + 1, (1,), generator=g)) for _ in range(batch)]


def hf_generate(model, batch: list[list[int]], new: int | list[int]) -> float:
    """Useful tokens/s of one static generate() batch: it runs until the longest request is done,
    and tokens past a request's own length are discarded."""
    wanted = new if isinstance(new, list) else [new] * len(batch)
    new = max(wanted)
    longest = max(len(p) for p in batch)
    ids = torch.zeros(len(batch), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding, as generate() wants for decoder-only models
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=0)
    seconds = time.perf_counter() - t0
    assert out.shape[1] - longest == new
    return sum(wanted) / seconds


def native_generate(engine: NativeEngine, batch: list[list[int]], new: int | list[int]) -> float:
    """The engine driven on this thread (``background=False``), the way a colocated rollout runs it:
    torch work from two threads contends for the OpenMP pool (see NativeEngine.run_until_idle)."""
    wanted = new if isinstance(new, list) else [new] * len(batch)
    t0 = time.perf_counter()
    futures = [engine.submit(GenerateRequest(f"b{i}", p, SamplingParams(max_new_tokens=n, temperature=1.0,
                                                                         ignore_eos=True)))
               for i, (p, n) in enumerate(zip(batch, wanted, strict=True))]
    engine.run_until_idle()
    outs = [f.result() for f in futures]
    seconds = time.perf_counter() - t0
    assert [len(o[0].output_ids) for o in outs] == wanted
    return sum(wanted) / seconds


def http_latency(name: str, requests: int, concurrency: int, new: int) -> dict | None:
    """p50/p95 of /generate under ``concurrency`` concurrent clients (None if no server module)."""
    try:
        import aiohttp  # noqa: F401

        import relax.engines.server  # noqa: F401
    except ImportError as e:
        print(f"http latency skipped: {e}", file=sys.stderr)
        return None
    with tempfile.TemporaryDirectory() as tmp:
        model = build(name)
        model.save_pretrained(tmp)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        proc = subprocess.Popen([sys.executable, "-m", "relax.engines.server", "--model-path", tmp, "--port", str(port),
                                 "--max-batch-size", "64"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url = f"http://127.0.0.1:{port}"
        try:
            for _ in range(300):
                try:
                    urllib.request.urlopen(url + "/health", timeout=1)
                    break
                except OSError:
                    time.sleep(0.2)
            return asyncio.run(_fire(url, requests, concurrency, new, model.config.vocab_size))
        finally:
            proc.terminate()
            proc.wait(timeout=30)


async def _fire(url: str, requests: int, concurrency: int, new: int, vocab: int) -> dict:
    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    batch = prompts(requests, vocab, seed=1)

    async def one(client, ids):
        async with sem:
            t0 = time.perf_counter()
            async with client.post(url + "/generate", json={"input_ids": ids, "sampling_params": {
                    "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}}) as r:
                r.raise_for_status()
                await r.json()
            latencies.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, ids) for ids in batch))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"requests": requests, "concurrency": concurrency, "new_tokens": new,
            "p50_ms": 1000 * latencies[len(latencies) // 2], "p95_ms": 1000 * latencies[int(len(latencies) * 0.95) - 1],
            "tokens_per_s": requests * new / wall}


def write_table(result: dict, output: Output) -> None:
    rows = ["| model | batch (varied = new tokens uniform in [N/4, N]) | HF generate useful tokens/s | "
            "native tokens/s | native / HF |", "|---|---|---|---|---|"]
    for name, m in result["models"].items():
        for b, r in m["batches"].items():
            rows.append(f"| {name} | {b} | {r['hf']:,.0f} | {r['native']:,.0f} | {r['native'] / r['hf']:.2f}x |")
    for name, m in result["models"].items():
        lat = m.get("http")
        if lat:
            rows += ["", f"{name}: HTTP /generate, {lat['requests']} requests from {lat['concurrency']} concurrent "
                     f"clients, {lat['new_tokens']} new tokens each: p50 {lat['p50_ms']:.0f} ms, p95 "
                     f"{lat['p95_ms']:.0f} ms, {lat['tokens_per_s']:,.0f} tokens/s."]
    output.table('engine', rows, f"## Native engine (`benchmarks/engine.py`, results/engine.json)\n\n{result['setup']}")


def bench_model(name: str, new: int, repeats: int) -> dict:
    """Tokens/s of HF generate() and the native engine, interleaved, at every batch size."""
    model = build(name)
    vocab = model.config.vocab_size
    engine = NativeEngine(model, None, max_batch_size=64, background=False)
    batches = {}
    try:
        native_generate(engine, prompts(4, vocab), 4)  # warm-up
        hf_generate(model, prompts(4, vocab), 4)
        for varied in (False, True):
            for b in (1, 8, 32, 64):
                batch, wanted = prompts(b, vocab), lengths_for(b, new, varied)
                hf, nat = [], []
                for _ in range(repeats):  # interleaved
                    hf.append(hf_generate(model, batch, wanted))
                    nat.append(native_generate(engine, batch, wanted))
                key = f"{b}{'-varied' if varied else ''}"
                batches[key] = {"hf": statistics.median(hf), "native": statistics.median(nat)}
                print(f"{name} batch {key}: HF {batches[key]['hf']:,.0f} tok/s, "
                      f"native {batches[key]['native']:,.0f} tok/s", file=sys.stderr)
    finally:
        engine.stop()
    return {"parameters": sum(p.numel() for p in model.parameters()), "batches": batches}


def summary(m: dict, suffix: str = "") -> dict:
    ratio = lambda k: round(m["batches"][k]["native"] / m["batches"][k]["hf"], 3)  # noqa: E731
    http = m.get("http")
    out = {"speedup_vs_hf_b32": ratio("32"), "tokens_per_s_b32": round(m["batches"]["32"]["native"]),
           "speedup_vs_hf_b32_varied": ratio("32-varied"), "speedup_vs_hf_b1": ratio("1"),
           "speedup_vs_hf_b64": ratio("64"), "speedup_vs_hf_b64_varied": ratio("64-varied"),
           "p95_latency_ms": round(http["p95_ms"], 1) if http else None,
           "p50_latency_ms": round(http["p50_ms"], 1) if http else None}
    return {k + suffix: v for k, v in out.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    new = 16 if args.quick else 32
    repeats = 1 if args.quick else 9  # short runs on a shared machine: the median of many
    models = {}
    for name in MODELS:
        models[name] = bench_model(name, new, repeats)
        models[name]["http"] = http_latency(name, 64 if args.quick else 128, 64, new)
    sizes = ", ".join(f"{name} {m['parameters'] / 1e6:.2f}M parameters" for name, m in models.items())
    setup = (f"Tiny Qwen2 decoders ({sizes}; see MODELS in the script), prompts of 16-32 tokens, {new} new tokens, "
             f"temperature 1, EOS ignored, median of {repeats} interleaved runs, {os.cpu_count()} CPU cores, float32.")
    result = {"quick": args.quick, "setup": setup, "models": models}
    output.write_json("engine", result)
    write_table(result, output)
    print(json.dumps({**summary(models["main"]), **summary(models["3m"], "_3m")}))


if __name__ == "__main__":
    main()
