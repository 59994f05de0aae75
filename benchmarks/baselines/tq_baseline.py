"""Baseline: throughput of the PyPI package `transferqueue` (0.1.11) on this machine.

Relax's TransferQueue is a durable sample queue on fsspec object stores; this script
measures the in-memory, Ray-based `transferqueue` package on the same workload so the
two can be compared. Run it with the separate venv made by benchmarks/tq_setup.sh
(the package installs top-level `tests`/`scripts` packages, so it must not go into
the project's own venv). It lives in its own folder because benchmarks/ holds
transfer_queue.py, which as the script's folder would shadow the package's `transfer_queue`:

    RAY_AUTH_MODE=disabled .venv-tq/bin/python benchmarks/baselines/tq_baseline.py \
        --samples 2000 --bytes 4096 --batch 200 --json

Workload: N samples, each one uint8 field `payload` of B bytes plus an int64 field
`policy_version`. The native streaming API of the package is used, in batches of K:

    put:  client.put(TensorDict(K samples), partition_id=P)        # N/K calls
    get:  meta = client.get_meta(data_fields, batch_size=K, partition_id=P,
                                 task_name="bench")   # consumer task: each sample once
          client.get_data(meta)                                    # N/K calls

Measured (median of 3 repeats after 1 warm-up; each repeat uses a fresh partition,
cleared afterwards, outside the timers):
  put_samples_per_s      N / time of all puts
  get_samples_per_s      N / time of all get_meta + get_data calls
  put_get_samples_per_s  N / (put time + get time): one sample in and out again
  put_get_mb_per_s       N * B / (put time + get time) / 1e6
  single_put_samples_per_s  puts of one sample per call (K=1), over min(N, --single)
                            samples (with --batch 1: the main put loop itself)
  setup_s                ray.init + transfer_queue.init (controller + 2 storage units)
Batch TensorDicts are built before the timers start. Every returned payload is
compared byte for byte with what went in (after timing); a mismatch exits non-zero.
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DEDUP_LOGS", "0")

import psutil  # noqa: E402  (a dependency of transferqueue)

# The package warns on every call when its default of 8 torch threads exceeds the cores.
os.environ.setdefault("TQ_NUM_THREADS", str(psutil.cpu_count(logical=False) or 1))

import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from tensordict import TensorDict  # noqa: E402

FIELDS = ["payload", "policy_version"]
TASK = "bench"


def make_batches(n, nbytes, k, seed):
    """Pre-built TensorDicts of at most k samples each, covering n samples."""
    gen = torch.Generator().manual_seed(seed)
    payload = torch.randint(0, 256, (n, nbytes), dtype=torch.uint8, generator=gen)
    version = torch.arange(n, dtype=torch.int64) + seed * 1_000_000
    return [
        TensorDict(
            {"payload": payload[i : i + k], "policy_version": version[i : i + k]}, batch_size=min(k, n - i)
        )
        for i in range(0, n, k)
    ]


def run_once(client, batches, partition):
    """Put all batches, then consume them all back; return (t_put, t_get, outputs)."""
    t0 = time.perf_counter()
    for td in batches:
        client.put(data=td, partition_id=partition)
    t1 = time.perf_counter()
    outs = []
    for td in batches:
        meta = client.get_meta(
            data_fields=FIELDS, batch_size=td.batch_size[0], partition_id=partition, task_name=TASK
        )
        outs.append(client.get_data(meta))
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1, outs


def verify(batches, outs, partition):
    """Byte-compare every returned sample with what was put (in put order)."""
    sent_p = torch.cat([td["payload"] for td in batches])
    sent_v = torch.cat([td["policy_version"] for td in batches])
    got_p, got_v = [], []
    for out in outs:
        p = out["payload"]
        # get_data returns per-sample fields as a jagged nested tensor: unbind it.
        got_p.extend(p.unbind() if p.is_nested else list(p))
        got_v.append(out["policy_version"].reshape(-1))
    got_v = torch.cat(got_v)
    if len(got_p) != len(sent_p):
        sys.exit(f"FAIL [{partition}]: got {len(got_p)} samples back, put {len(sent_p)}")
    # The streaming sampler hands samples out in insertion order; map by version anyway.
    order = torch.argsort(got_v)
    if not torch.equal(got_v[order], sent_v):
        sys.exit(f"FAIL [{partition}]: policy_version values differ from what was put")
    for j, i in enumerate(order.tolist()):
        if got_p[i].numpy().tobytes() != sent_p[j].numpy().tobytes():
            sys.exit(f"FAIL [{partition}]: payload bytes of sample {j} differ")


def single_puts(client, ones, partition):
    """Time one-sample puts; then read them back in one batch and verify them."""
    t0 = time.perf_counter()
    for td in ones:
        client.put(data=td, partition_id=partition)
    elapsed = time.perf_counter() - t0
    meta = client.get_meta(data_fields=FIELDS, batch_size=len(ones), partition_id=partition, task_name=TASK)
    verify(ones, [client.get_data(meta)], partition)
    client.clear_partition(partition)
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--bytes", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--single", type=int, default=200, help="max samples for the one-sample-per-put measurement (0: skip)"
    )
    ap.add_argument("--json", action="store_true", help="print only the JSON summary to stdout")
    a = ap.parse_args()
    n, b, k = a.samples, a.bytes, a.batch
    log = (lambda *x: print(*x, file=sys.stderr)) if a.json else print

    t0 = time.perf_counter()
    # transferqueue's default init takes 3 CPUs (controller + 2 storage units), 1 each.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    res = {"put": [], "get": [], "single": []}
    single = k == 1 or a.single > 0
    m = single_t = 0
    try:
        tq.init()
        client = tq.get_client()
        setup_s = time.perf_counter() - t0
        log(f"setup {setup_s:.2f}s (transferqueue {tq.__version__})")
        for rep in range(a.repeats + 1):  # rep 0 is the warm-up
            batches = make_batches(n, b, k, seed=rep)
            part = f"bench_{rep}"
            t_put, t_get, outs = run_once(client, batches, part)
            verify(batches, outs, part)
            client.clear_partition(part)
            if k == 1:  # the main loop already is the one-sample-per-put case
                m, single_t = n, t_put
            elif a.single:
                m = min(n, a.single)
                single_t = single_puts(client, make_batches(m, b, 1, 100 + rep), f"single_{rep}")
            log(
                f"rep {rep}{' (warm-up)' if rep == 0 else ''}: put {t_put:.3f}s get {t_get:.3f}s"
                + (f" single-put {single_t:.3f}s/{m}" if single else "")
            )
            if rep:
                res["put"].append(t_put)
                res["get"].append(t_get)
                res["single"].append(m / single_t if single else None)
    finally:
        tq.close()
        ray.shutdown()

    med = statistics.median
    t_put, t_get = med(res["put"]), med(res["get"])
    t_both = med([p + g for p, g in zip(res["put"], res["get"], strict=True)])
    out = {
        "package": "transferqueue",
        "version": tq.__version__,
        "api": "TransferQueueClient.put / get_meta(task_name) / get_data",
        "samples": n,
        "bytes": b,
        "batch": k,
        "repeats": a.repeats,
        "put_samples_per_s": round(n / t_put, 1),
        "get_samples_per_s": round(n / t_get, 1),
        "put_get_samples_per_s": round(n / t_both, 1),
        "put_get_mb_per_s": round(n * b / t_both / 1e6, 2),
        "single_put_samples_per_s": round(med(res["single"]), 1) if single else None,
        "single_put_samples": m,
        "setup_s": round(setup_s, 2),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
