"""What the engine server's guard costs and what it buys: a 10 MB request against /health, and the
per-request price of validating a /generate request.

1. **Huge body.** A native engine server (a real subprocess, the tiny model of the tests) is sent a
   10 MB text prompt while a client polls ``/health`` every 20 ms. Side by side in one run: the
   server as shipped (``--max-body-bytes`` 8 MiB: a 413 from the declared length) and the same
   server with the limit raised to 64 MiB (it reads, parses and tokenizes all of it, off the event
   loop, before the context check refuses it). Reported: time to the answer, its status, and /health p50/p95/max while
   the
   big request was in flight.
2. **The HTTP path** at 64 concurrent clients (256 requests, 16 new tokens), side by side: without a
   token and with the token check, each plain and streaming (SSE), after one warm-up round.
3. **Validation cost.** The checks a /generate request passes before it joins a batch
   (``SamplingParams.from_json``, token ids inside the vocabulary, the context budget), timed over
   many calls, against the p50 latency of the same request at 64 concurrent clients: the ratio is
   the share of a request's time that validation takes.

    python benchmarks/engine_guard.py

Writes engine_guard.json and its table to the untracked results folder (``--update-docs``:
benchmarks/results/engine_guard.json and docs/benchmarks.md; see output.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from engine import _fire, build
from output import Output, add_arguments

from relax.engines.frontend import Frontend
from relax.engines.types import SamplingParams

REPO = Path(__file__).resolve().parents[1]


def serve(model_dir: str, port: int, max_body: int) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "relax.engines.server", "--model-path", model_dir, "--port",
                             str(port), "--max-batch-size", "64", "--max-body-bytes", str(max_body)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
    for _ in range(300):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("the engine server did not start")


def huge_body(url: str, megabytes: int = 10) -> dict:
    body = json.dumps({"text": "hello world " * (megabytes * (1 << 20) // 12), "sampling_params": {
        "max_new_tokens": 1}}).encode()
    health: list[float] = []
    answer: dict = {}

    def big() -> None:
        t0 = time.perf_counter()
        req = urllib.request.Request(url + "/generate", data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                answer["status"] = r.status
        except urllib.error.HTTPError as e:
            answer["status"] = e.code
        except OSError:  # the server answered and closed while the body was still being sent
            answer["status"] = 413
        answer["seconds"] = time.perf_counter() - t0

    thread = threading.Thread(target=big)
    thread.start()
    while thread.is_alive():
        t0 = time.perf_counter()
        urllib.request.urlopen(url + "/health", timeout=60).read()
        health.append(1000 * (time.perf_counter() - t0))
        time.sleep(0.02)
    thread.join()
    health.sort()
    return {"bytes": len(body), "status": answer["status"], "answer_s": round(answer["seconds"], 3),
            "health_p50_ms": round(statistics.median(health), 2) if health else None,
            "health_p95_ms": round(health[max(0, int(len(health) * 0.95) - 1)], 2) if health else None,
            "health_max_ms": round(health[-1], 2) if health else None, "health_probes": len(health)}


async def fire(url: str, requests: int, concurrency: int, new: int, vocab: int, token: str | None,
               stream: bool) -> dict:
    """``requests`` /generate calls from ``concurrency`` clients: p50/p95 latency (to the last byte) and tokens/s."""
    import asyncio

    import aiohttp

    sem = asyncio.Semaphore(concurrency)
    latencies: list[float] = []
    headers = {"Authorization": f"Bearer {token}"} if token else None
    batch = [[(7 * i + j) % vocab for j in range(16 + i % 16)] for i in range(requests)]

    async def one(client, ids):
        async with sem:
            t0 = time.perf_counter()
            body = {"input_ids": ids, "stream": stream, "sampling_params": {
                "max_new_tokens": new, "temperature": 1.0, "ignore_eos": True}}
            async with client.post(url + "/generate", json=body) as r:
                r.raise_for_status()
                await r.read()
            latencies.append(time.perf_counter() - t0)

    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=300)) as client:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(client, ids) for ids in batch))
        wall = time.perf_counter() - t0
    latencies.sort()
    return {"p50_ms": round(1000 * latencies[len(latencies) // 2], 1),
            "p95_ms": round(1000 * latencies[int(len(latencies) * 0.95) - 1], 1),
            "tokens_per_s": round(requests * new / wall)}


class _Engine:  # what Frontend's checks read of an engine
    max_context_length = 512

    def model_info(self) -> dict:
        return {"vocab_size": 512}


def validation_seconds(calls: int = 20000) -> float:
    fe = Frontend(_Engine(), "model")
    ids = list(range(64))
    sp = {"max_new_tokens": 16, "temperature": 1.0, "top_p": 1.0, "ignore_eos": True}
    t0 = time.perf_counter()
    for _ in range(calls):
        params = SamplingParams.from_json(sp)
        fe.check_ids(ids)
        fe.check_ids(params.stop_token_ids)
        fe.check_length(len(ids), params, explicit=True)
    return (time.perf_counter() - t0) / calls


def main() -> None:
    import asyncio

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    output = Output.from_args(parser.parse_args())
    os.environ.pop("RELAX_ENGINE_TOKEN", None)  # the generation routes stay open without one
    result: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build("main")
        model.save_pretrained(tmp)
        for name, limit in (("limit 8 MiB (shipped)", 8 << 20), ("limit raised to 64 MiB", 64 << 20)):
            port = 30000 + os.getpid() % 1000 + (0 if limit == 8 << 20 else 1)
            proc = serve(tmp, port, limit)
            try:
                result[name] = huge_body(f"http://127.0.0.1:{port}")
                if limit == 8 << 20:
                    result["latency_c64"] = asyncio.run(_fire(f"http://127.0.0.1:{port}", 256, 64, 16,
                                                              model.config.vocab_size))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
        # the HTTP path at 64 concurrent clients, side by side: no token and with the token check, plain and streaming
        result["http_c64"] = {}
        for token in (None, "bench-token"):
            if token:
                os.environ["RELAX_ENGINE_TOKEN"] = token  # the server inherits it and checks every request
            port = 31000 + os.getpid() % 1000 + (1 if token else 0)
            proc = serve(tmp, port, 8 << 20)
            try:
                for stream in (False, True):
                    asyncio.run(fire(f"http://127.0.0.1:{port}", 64, 64, 16, model.config.vocab_size, token, stream))
                    key = f"{'token' if token else 'no token'}, {'streaming' if stream else 'plain'}"
                    result["http_c64"][key] = asyncio.run(fire(f"http://127.0.0.1:{port}", 256, 64, 16,
                                                               model.config.vocab_size, token, stream))
            finally:
                proc.terminate()
                proc.wait(timeout=30)
            os.environ.pop("RELAX_ENGINE_TOKEN", None)
    check = validation_seconds()
    result["validation_us"] = round(1e6 * check, 2)
    result["validation_share_of_p50"] = round(check / (result["latency_c64"]["p50_ms"] / 1000), 6)
    output.write_json("engine_guard", result)
    rows = ["| server | 10 MB request answered | in | /health p50 / p95 / max while it ran |", "|---|---|---|---|"]
    for name in ("limit 8 MiB (shipped)", "limit raised to 64 MiB"):
        r = result[name]
        rows.append(f"| {name} | {r['status']} | {r['answer_s']:.3f} s | {r['health_p50_ms']} / {r['health_p95_ms']} / "
                    f"{r['health_max_ms']} ms |")
    rows.append(f"| validation of one /generate request | | {result['validation_us']} us | "
                f"{100 * result['validation_share_of_p50']:.3f} % of the request's p50 at 64 concurrent clients "
                f"({result['latency_c64']['p50_ms']:.0f} ms) |")
    rows += ["", "| HTTP /generate, 256 requests from 64 clients, 16 new tokens | p50 | p95 | tokens/s |",
             "|---|---|---|---|"]
    for key, r in result["http_c64"].items():
        rows.append(f"| {key} | {r['p50_ms']} ms | {r['p95_ms']} ms | {r['tokens_per_s']:,} |")
    output.table("engine-guard", rows, "## Engine guard (`benchmarks/engine_guard.py`, results/engine_guard.json)\n\n"
                 "A 10 MB request to the native engine server (tiny model, real subprocess) while /health is polled "
                 "every 20 ms, with the shipped 8 MiB body limit and with it raised to 64 MiB; and the time the "
                 "per-request validation takes. 2 CPU cores.")
    print(json.dumps({k: result[k] for k in ("validation_us", "validation_share_of_p50")}))


if __name__ == "__main__":
    main()
