"""Data-layer benchmark: what a snapshot costs, and jsonl against parquet for reading rows.

Measured side by side in one process, reported as ratios:
  * snapshot of the built-in suite (tiny-cpu defaults): first write vs a rerun that only
    re-hashes the content and finds the manifest (what every cached `make run` pays);
  * the same snapshot written to a local folder vs to S3 (a moto server on loopback);
  * reading 20,000 text rows back as Samples: jsonl vs parquet.

    python benchmarks/bench_data.py [--update-docs] [--out PATH]

Writes data.json to the untracked results folder (``--update-docs``: benchmarks/results/data.json;
see output.py).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from pathlib import Path

from output import Output, add_arguments

from relax.config import DataConfig
from relax.data.readers import read_samples, write_jsonl, write_parquet
from relax.data.samples import Message, Sample
from relax.data.sources import plan_from_config, snapshot_from_config


def timed(fn, repeat: int = 3) -> float:
    """Median wall time of ``fn()`` over ``repeat`` runs (seconds)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            break
        except OSError:
            time.sleep(0.2)
    os.environ.update(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench")
    return proc, endpoint


def bench_snapshot(tmp: Path) -> dict:
    data = DataConfig()  # the tiny-cpu built-in suite
    plan_s = timed(lambda: plan_from_config(data))

    def fresh_local():
        shutil.rmtree(tmp / "root", ignore_errors=True)
        snapshot_from_config(data, str(tmp / "root"))

    create_local = timed(fresh_local)
    reuse_local = timed(lambda: snapshot_from_config(data, str(tmp / "root")))
    info = snapshot_from_config(data, str(tmp / "root"))
    proc, _ = start_moto()
    try:
        import fsspec

        def fresh_s3():
            bucket = f"bench-{uuid.uuid4().hex[:8]}"
            fsspec.filesystem("s3").mkdir(bucket)
            snapshot_from_config(data, f"s3://{bucket}")

        create_s3 = timed(fresh_s3)
    finally:
        proc.terminate()
    return {
        "rows": sum(info.rows.values()), "media_files": info.media_files, "media_bytes": info.media_bytes,
        "plan_s": plan_s, "create_local_s": create_local, "reuse_local_s": reuse_local, "create_s3_s": create_s3,
        "reuse_over_create": reuse_local / create_local, "s3_over_local": create_s3 / create_local,
    }


def bench_readers(tmp: Path, n: int = 20_000) -> dict:
    rows = [Sample(id=f"r{i}", messages=(Message("system", "Answer briefly."), Message("user", f"What is {i} + 1?")),
                   answer=str(i + 1), task="arithmetic", metadata={"i": i}) for i in range(n)]
    write_jsonl(str(tmp / "rows.jsonl"), rows)
    write_parquet(str(tmp / "rows.parquet"), rows)
    jsonl = timed(lambda: sum(1 for _ in read_samples(str(tmp / "rows.jsonl"))))
    parquet = timed(lambda: sum(1 for _ in read_samples(str(tmp / "rows.parquet"))))
    return {"rows": n, "jsonl_rows_per_s": n / jsonl, "parquet_rows_per_s": n / parquet,
            "jsonl_bytes": (tmp / "rows.jsonl").stat().st_size, "parquet_bytes": (tmp / "rows.parquet").stat().st_size,
            "parquet_over_jsonl_time": parquet / jsonl}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = {"machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
                  "snapshot": bench_snapshot(Path(d)), "readers": bench_readers(Path(d))}
    Output.from_args(args).write_json("data", result)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
