"""TransferQueue throughput and latency, side by side with its limits and a peer.

For small (~4 KB) and large (~1 MB) samples, on file:// and s3:// (a moto server on
loopback), in one run:

  relax        put K samples per shard, then a consumer group takes them back in steps
               of K (commit records, cursor records and checksums included)
  raw          fsspec write + read of the same bytes, one object per K samples: the limit
  transferqueue  the PyPI package (in-memory on Ray), same samples, same K; run in its
               own venv (benchmarks/tq_setup.sh) because it shadows top-level packages

plus put-to-visible latency: a producer process commits one sample at a time and a
reader in another process waits for it (polling, default interval), and the same inside
one process (the in-process wake-up fast path).

    python benchmarks/transfer_queue.py [--quick] [--no-tq]

Writes transfer_queue.json and the transfer-queue table to the untracked results folder
(``--update-docs``: benchmarks/results/transfer_queue.json and docs/benchmarks.md; see
output.py), and prints one JSON object as its last line.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import fsspec
import numpy as np
from bench_data import start_moto  # a sibling script: benchmarks/ is sys.path[0]
from output import Output, add_arguments

from relax import objstore
from relax.transfer.columns import Field
from relax.transfer.consumer import ConsumerGroup
from relax.transfer.queue import TransferQueue

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PAYLOAD = [Field("payload", kind="bytes")]


def payloads(n: int, nbytes: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes() for _ in range(n)]


def relax_put_get(url: str, data: list[bytes], k: int) -> dict:
    run = uuid.uuid4().hex[:8]
    queue = TransferQueue(url, run, "bench")
    producer = queue.producer("producer", PAYLOAD, tokens_field=None)
    t0 = time.perf_counter()
    for start in range(0, len(data), k):
        producer.put([{"id": f"s{i}", "policy_version": 0, "payload": data[i]}
                      for i in range(start, min(start + k, len(data)))])
    put_s = time.perf_counter() - t0
    group = ConsumerGroup(TransferQueue(url, run, "bench"), "actor", ["payload"], batch_groups=k)
    got: list[bytes] = []
    t0 = time.perf_counter()
    for step in range(len(data) // k):
        got += group.take(step, current_version=0, timeout=60).fields["payload"]
    get_s = time.perf_counter() - t0
    if got != data[: len(got)] or len(got) != len(data) // k * k:
        raise SystemExit("relax returned different bytes")
    return _rates(len(got), len(data[0]), put_s, get_s)


def raw_put_get(url: str, data: list[bytes], k: int) -> dict:
    fs, base = objstore.open_fs(objstore.join(url, f"raw-{uuid.uuid4().hex[:8]}"))
    fs.makedirs(base, exist_ok=True)
    t0 = time.perf_counter()
    for start in range(0, len(data), k):
        fs.pipe_file(f"{base}/{start:08d}", b"".join(data[start:start + k]))
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = [fs.cat_file(f"{base}/{start:08d}") for start in range(0, len(data), k)]
    get_s = time.perf_counter() - t0
    if b"".join(back) != b"".join(data):
        raise SystemExit("raw read returned different bytes")
    return _rates(len(data), len(data[0]), put_s, get_s)


def raw_chunked_put_get(url: str, data: list[bytes], k: int) -> dict:
    """The best a local folder can do: plain open/write in 1 MiB pieces and read, no fsspec layer."""
    base = Path(objstore.open_fs(url)[1]) / f"chunked-{uuid.uuid4().hex[:8]}"
    base.mkdir(parents=True)
    t0 = time.perf_counter()
    for start in range(0, len(data), k):
        with open(base / f"{start:08d}", "wb") as fh:
            for sample in data[start:start + k]:
                view = memoryview(sample)
                for at in range(0, len(view), objstore.WRITE_CHUNK):
                    fh.write(view[at:at + objstore.WRITE_CHUNK])
    put_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    back = [(base / f"{start:08d}").read_bytes() for start in range(0, len(data), k)]
    get_s = time.perf_counter() - t0
    if b"".join(back) != b"".join(data):
        raise SystemExit("raw read returned different bytes")
    return _rates(len(data), len(data[0]), put_s, get_s)


def _rates(n: int, nbytes: int, put_s: float, get_s: float) -> dict:
    return {"samples": n, "put_get_samples_per_s": n / (put_s + get_s), "put_samples_per_s": n / put_s,
            "get_samples_per_s": n / get_s, "put_get_mb_per_s": n * nbytes / (put_s + get_s) / 1e6}


def side_by_side(fns: dict, repeats: int) -> dict:
    """Median of ``repeats`` runs of each function, interleaved, each after ``os.sync()``: the
    kernel throttles writers while it flushes earlier dirty pages, which would otherwise
    penalise whichever contender runs second."""
    runs: dict[str, list[dict]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            os.sync()
            runs[name].append(fn())
    return {name: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for name, rs in runs.items()}


def transferqueue(n: int, nbytes: int, k: int) -> dict | None:
    if subprocess.run(["bash", str(HERE / "tq_setup.sh")], capture_output=True).returncode != 0:
        print("transferqueue baseline unavailable (tq_setup.sh failed)", file=sys.stderr)
        return None
    out = subprocess.run(
        [
            str(REPO / ".venv-tq/bin/python"),
            str(HERE / "baselines" / "tq_baseline.py"),
            "--samples",
            str(n),
            "--bytes",
            str(nbytes),
            "--batch",
            str(k),
            "--json",
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "RAY_AUTH_MODE": "disabled"},
    )
    if out.returncode != 0:
        print(f"transferqueue baseline failed:\n{out.stderr[-2000:]}", file=sys.stderr)
        return None
    return json.loads(out.stdout.strip().splitlines()[-1])


READER = """
import sys, time, json
from relax.transfer.queue import TransferQueue
q = TransferQueue(sys.argv[1], "lat", "t")
seen, lat = set(), []
print("ready", flush=True)
while len(lat) < int(sys.argv[2]):
    q.wait_for_new(timeout=5)
    now = time.time()
    for sid, m in q.state.samples.items():
        if sid not in seen:
            seen.add(sid)
            lat.append(now - m.order[0])
print(json.dumps(lat))
"""


def visible_latency(url: str, count: int) -> dict:
    """p50/p95 ms from commit to a reader in another process noticing it, and in the same process."""
    queue = TransferQueue(url, "lat", "t")
    producer = queue.producer("w", PAYLOAD, tokens_field=None)
    reader = subprocess.Popen([sys.executable, "-c", READER, url, str(count)], stdout=subprocess.PIPE, text=True)
    assert reader.stdout.readline().strip() == "ready"
    for i in range(count):
        producer.put([{"id": f"x{i}", "payload": b"x" * 64}])
        time.sleep(0.03)
    cross = json.loads(reader.communicate(timeout=60)[0].strip().splitlines()[-1])
    local_q = TransferQueue(url, "lat", "t")
    local: list[float] = []

    def wait_one() -> None:
        local_q.wait_for_new(timeout=5)
        local.append(time.time())

    for i in range(count):
        t = threading.Thread(target=wait_one)
        t.start()
        time.sleep(0.005)
        producer.put([{"id": f"y{i}", "payload": b"y" * 64}])
        committed = local_q.state.samples.get(f"y{i}") or queue.state.samples[f"y{i}"]
        t.join()
        local[-1] -= committed.order[0]
    ms = lambda xs, q: 1000 * float(np.percentile(xs, q))  # noqa: E731
    return {"cross_process_p50_ms": ms(cross, 50), "cross_process_p95_ms": ms(cross, 95),
            "in_process_p50_ms": ms(local, 50), "in_process_p95_ms": ms(local, 95)}


def write_table(result: dict, output: Output) -> None:
    rows = ["| samples | store | relax put+get samples/s | relax MB/s | raw fsspec MB/s | relax / raw | "
            "raw 1 MiB writes MB/s | relax / that | transferqueue samples/s | relax / transferqueue |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for case in result["cases"]:
        tq = case.get("transferqueue")
        tq_rate = f"{tq['put_get_samples_per_s']:,.0f}" if tq else "n/a"
        ratio = f"{case['relax']['put_get_samples_per_s'] / tq['put_get_samples_per_s']:.1f}x" if tq else "n/a"
        chunked = f"{case['raw_chunked']['put_get_mb_per_s']:,.1f}" if "raw_chunked" in case else "-"
        chunked_ratio = f"{case['relax_vs_raw_chunked']:.2f}" if "raw_chunked" in case else "-"
        rows.append(f"| {case['n']} x {case['bytes']:,} B (K={case['k']}) | {case['store']} | "
                    f"{case['relax']['put_get_samples_per_s']:,.0f} | {case['relax']['put_get_mb_per_s']:,.1f} | "
                    f"{case['raw']['put_get_mb_per_s']:,.1f} | {case['relax_vs_raw']:.2f} | "
                    f"{chunked} | {chunked_ratio} | {tq_rate} | {ratio} |")
    lat = result["latency"]
    rows += ["", f"Put-to-visible latency (file://): another process, polling at the default 50 ms: "
             f"p50 {lat['cross_process_p50_ms']:.1f} ms, p95 {lat['cross_process_p95_ms']:.1f} ms; same process "
             f"(wake-up fast path): p50 {lat['in_process_p50_ms']:.2f} ms, p95 {lat['in_process_p95_ms']:.2f} ms."]
    output.table(
        "transfer_queue", rows, "## TransferQueue (`benchmarks/transfer_queue.py`, results/transfer_queue.json)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer samples and repeats (under a minute)")
    parser.add_argument("--no-tq", action="store_true", help="skip the transferqueue package")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    repeats = 1 if args.quick else 3
    small_n, large_n = (2000, 32) if args.quick else (10000, 64)
    moto, _ = start_moto()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fsspec.filesystem("s3").mkdir(bucket)
            stores = {"file": f"file://{tmp}", "s3": f"s3://{bucket}"}
            cases = []
            for n, nbytes, k in ((small_n, 4096, 200), (large_n, 1 << 20, 8)):
                data = payloads(n, nbytes)
                tq = None if args.no_tq else transferqueue(n, nbytes, k)
                for store, url in stores.items():
                    contenders = {"relax": relax_put_get, "raw": raw_put_get}
                    if store == "file":
                        contenders["raw_chunked"] = raw_chunked_put_get
                    fns = {name: functools.partial(fn, url, data, k) for name, fn in contenders.items()}
                    both = side_by_side(fns, repeats)
                    relax, raw = both["relax"], both["raw"]
                    case = {"n": n, "bytes": nbytes, "k": k, "store": store, "relax": relax, "raw": raw,
                            "relax_vs_raw": relax["put_get_mb_per_s"] / raw["put_get_mb_per_s"], "transferqueue": tq}
                    if "raw_chunked" in both:
                        case["raw_chunked"] = both["raw_chunked"]
                        case["relax_vs_raw_chunked"] = (
                            relax["put_get_mb_per_s"] / both["raw_chunked"]["put_get_mb_per_s"]
                        )
                    cases.append(case)
                    print(f"{store} {nbytes} B: relax {relax['put_get_samples_per_s']:,.0f}/s, "
                          f"raw {raw['put_get_samples_per_s']:,.0f}/s", file=sys.stderr)
            latency = visible_latency(stores["file"], 20 if args.quick else 50)
    finally:
        moto.terminate()
    result = {"quick": args.quick, "cases": cases, "latency": latency}
    output.write_json("transfer_queue", result)
    write_table(result, output)
    small = next(c for c in cases if c["bytes"] == 4096 and c["store"] == "file")
    large = next(c for c in cases if c["bytes"] == 1 << 20 and c["store"] == "file")
    tq = small["transferqueue"]
    summary = {
        "large_vs_raw": round(large["relax_vs_raw"], 3),
        "large_vs_raw_chunked": round(large["relax_vs_raw_chunked"], 3),
        "large_vs_raw_s3": round(
            next(c for c in cases if c["bytes"] == 1 << 20 and c["store"] == "s3")["relax_vs_raw"], 3
        ),
        "small_samples_per_s": round(small["relax"]["put_get_samples_per_s"]),
        "small_vs_transferqueue": round(small["relax"]["put_get_samples_per_s"] / tq["put_get_samples_per_s"], 2)
        if tq
        else None,
        "small_vs_transferqueue_single_put": round(
            small["relax"]["put_get_samples_per_s"] / tq["single_put_samples_per_s"], 1
        )
        if tq
        else None,
        "p50_visible_ms": round(latency["cross_process_p50_ms"], 2),
        "p50_visible_in_process_ms": round(latency["in_process_p50_ms"], 3),
    }
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
