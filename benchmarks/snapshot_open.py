"""Opening a delta snapshot: the log records since its base fetched together, against one by one.

A delta snapshot (relax/transfer/queue.py, ``compact``) names how far each writer's log
goes, so ``state_at`` knows every record it must fold. It fetches them with one batched
``objstore.read_many`` (s3fs issues the GETs concurrently); the alternative, in the same
run, probes them one GET at a time (``read_records``, what a poll of an unknown log tail
does). On file://, s3:// (a moto server on loopback), and the same s3:// topic through a proxy
that adds a network round trip to every request (``--rtt-ms``, default 20; latency_proxy.py),
as a remote object store would:

    python benchmarks/snapshot_open.py [--quick] [--rtt-ms 20]

Writes snapshot_open.json and its table to the untracked results folder (``--update-docs``:
benchmarks/results/snapshot_open.json and docs/benchmarks.md; see output.py) and prints one
JSON object as its last line.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
import uuid

import fsspec
import s3fs
from bench_data import start_moto  # a sibling script: benchmarks/ is sys.path[0]
from latency_proxy import LatencyProxy
from output import Output, add_arguments

import relax.transfer.queue as queue_module
from relax.transfer.columns import Field
from relax.transfer.queue import TransferQueue
from relax.transfer.writers import read_records

PAYLOAD = [Field("payload", kind="bytes")]


def one_by_one(url: str, start: int, stop: int):
    """The alternative: probe records start..stop with one GET each."""
    return itertools.islice(read_records(url, start), stop - start + 1)


def build_topic(url: str, full_commits: int, delta_commits: int, per_commit: int) -> tuple[str, int]:
    """A topic with a full snapshot after ``full_commits`` commits and a delta after ``delta_commits`` more."""
    run = uuid.uuid4().hex[:8]
    queue = TransferQueue(url, run, "bench")
    producer = queue.producer("producer", PAYLOAD, tokens_field=None)
    n = 0
    for commits in (full_commits, delta_commits):
        for _ in range(commits):
            producer.put([{"id": f"s{n + i}", "policy_version": 0, "payload": b"x" * 64} for i in range(per_commit)])
            n += per_commit
        version = queue.compact()
    return run, version


def time_opens(url: str, run: str, version: int, fetchers: dict, repeats: int) -> dict[str, tuple[float, int]]:
    """Median seconds to open the topic and read snapshot ``version`` with each fetcher, and the
    samples it holds; the fetchers take turns, after one round that warms up caches and connections."""
    times: dict[str, list[float]] = {name: [] for name in fetchers}
    samples: dict[str, int] = {}
    for i in range(repeats + 1):
        # alternate the order and collect garbage untimed: otherwise the second open of a round
        # pays for collecting the first one's 3000-sample state
        for name, fetch in (list(fetchers.items()) if i % 2 else list(fetchers.items())[::-1]):
            queue_module.read_record_range = fetch
            gc.collect()
            t0 = time.perf_counter()
            samples[name] = len(TransferQueue(url, run, "bench").state_at(version).samples)
            if i:
                times[name].append(time.perf_counter() - t0)
    return {name: (statistics.median(t), samples[name]) for name, t in times.items()}


def use_endpoint(endpoint: str) -> None:
    """Point s3fs at ``endpoint``; cached filesystem instances would keep the old one."""
    os.environ["AWS_ENDPOINT_URL"] = endpoint
    s3fs.S3FileSystem.clear_instance_cache()


def compare(key: str, store: str, url: str, run: str, version: int, commits: int, repeats: int, batched) -> dict:
    got = time_opens(url, run, version, {"one_by_one": one_by_one, "batched": batched}, repeats)
    (seq_s, n_seq), (bat_s, n_bat) = got["one_by_one"], got["batched"]
    if n_seq != n_bat or n_bat != 8 * commits:
        raise SystemExit(f"{store}: the two opens folded {n_seq} and {n_bat} samples")
    print(f"{store}: one by one {seq_s:.3f} s, batched {bat_s:.3f} s", file=sys.stderr)
    return {
        "key": key,
        "store": store,
        "samples": n_bat,
        "one_by_one_s": seq_s,
        "batched_s": bat_s,
        "speedup": seq_s / bat_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller topic and fewer repeats")
    parser.add_argument("--rtt-ms", type=float, default=20.0,
                        help="round trip the proxy adds to each S3 request (0 skips that case)")
    add_arguments(parser)
    args = parser.parse_args()
    output = Output.from_args(args)
    full, delta, repeats = (50, 40, 2) if args.quick else (200, 190, 6)
    batched = queue_module.read_record_range
    moto, endpoint = start_moto()
    cases = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fsspec.filesystem("s3").mkdir(bucket)
            topics = {}
            for store, url in (("file", f"file://{tmp}"), ("s3", f"s3://{bucket}")):
                topics[store] = (url, *build_topic(url, full, delta, per_commit=8))
                cases.append(compare(store, store, *topics[store], full + delta, repeats, batched))
            if args.rtt_ms:
                host, port = endpoint.removeprefix("http://").split(":")
                proxy = LatencyProxy(host, int(port), rtt_s=args.rtt_ms / 1000)
                use_endpoint(proxy.start())
                try:  # the s3 topic above, read through the proxy
                    cases.append(compare("s3_rtt", f"s3 + {args.rtt_ms:g} ms round trip", *topics["s3"],
                                         full + delta, repeats, batched))
                finally:
                    use_endpoint(endpoint)
                    proxy.stop()
    finally:
        queue_module.read_record_range = batched
        moto.terminate()
    result = {"quick": args.quick, "records_folded": delta, "rtt_ms": args.rtt_ms, "cases": cases,
              "setup": f"a topic of {full} commits, a full snapshot, {delta} more commits (8 samples each) and a "
                       f"delta snapshot; time to open the delta (state_at), median of {repeats}, 2 CPU cores."}
    output.write_json("snapshot_open", result)
    rows = [
        f"Records folded: {delta}.",
        "",
        "| store | one GET at a time s | batched s | speed-up |",
        "|---|---|---|---|",
    ]
    rows += [f"| {c['store']} | {c['one_by_one_s']:.3f} | {c['batched_s']:.3f} | "
             f"{c['speedup']:.1f}x |" for c in cases]
    output.table("snapshot_open", rows, "## Opening a delta snapshot (`benchmarks/snapshot_open.py`, "
                 "results/snapshot_open.json)\n\n" + result["setup"])
    print(json.dumps({c["key"] + "_speedup": round(c["speedup"], 2) for c in cases}))


if __name__ == "__main__":
    main()
