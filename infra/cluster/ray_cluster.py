"""One Ray cluster per Ray task attempt, shaped as KubeRay would make it from the task's spec.

The task template's ``custom.rayCluster`` (what the Flyte Ray plugin registers) names a head and
worker groups with their ``rayStartParams``; here every node is a ``ray start --block`` process
group on this machine (its own ports and temp folder, so two clusters live side by side), and the
cluster is torn down with SIGKILL after the attempt, as a deleted RayJob's pods would be.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

OBJECT_STORE_BYTES = 200_000_000  # the roles pass data through the object store, not Ray's


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# every service of a node on a port of its own: Ray's defaults (workers on 10002-19999, the agent on
# 52365, ...) would collide with the other clusters on this machine (another role group's, a test's)
NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")


def _start_params(group: dict) -> list[str]:
    params = group.get("rayStartParams", {})
    return [f"--num-cpus={params.get('num-cpus', '1')}", f"--num-gpus={params.get('num-gpus', '0')}",
            f"--object-store-memory={OBJECT_STORE_BYTES}", "--min-worker-port=0", "--max-worker-port=0",
            *(f"{flag}={free_port()}" for flag in NODE_PORTS), "--disable-usage-stats", "--block"]


class RayCluster:
    """A head plus ``replicas`` nodes per worker group of ``spec`` (``custom["rayCluster"]``)."""

    def __init__(self, spec: dict, log_dir: Path, start_timeout_s: float = 120.0):
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.temp = tempfile.mkdtemp(prefix=f"rc{self.port}-", dir="/tmp")  # short: Ray's socket paths are capped
        self.procs: list[subprocess.Popen] = []
        ray = str(Path(sys.executable).with_name("ray"))
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
        env.pop("RAY_ADDRESS", None)
        head = [ray, "start", "--head", f"--port={self.port}", "--include-dashboard=false", f"--temp-dir={self.temp}",
                f"--ray-client-server-port={free_port()}", *_start_params(spec["headGroupSpec"])]
        workers = [(g, i) for g in spec.get("workerGroupSpec", []) for i in range(int(g.get("replicas", 0)))]
        self.nodes = 1 + len(workers)
        log_dir.mkdir(parents=True, exist_ok=True)
        try:
            self._spawn(head, log_dir / "head.log", env)
            for g, i in workers:
                self._spawn([ray, "start", f"--address={self.address}", *_start_params(g)],
                            log_dir / f"{g.get('groupName', 'workers')}-{i}.log", env)
            self._wait_up(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _spawn(self, cmd: list[str], log: Path, env: dict[str, str]) -> None:
        with open(log, "wb") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=env, start_new_session=True))

    def _wait_up(self, timeout_s: float) -> None:
        """Until every node has joined (asked of the GCS by a throwaway driver process)."""
        probe = (f"import ray; ray.init(address='{self.address}', logging_level='ERROR'); "
                 f"print(sum(n['Alive'] for n in ray.nodes()))")
        deadline = time.monotonic() + timeout_s
        while True:
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"a Ray node of {self.address} exited with {p.returncode} as it started")
            out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
            if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(self.nodes)]:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray cluster {self.address}: {self.nodes} nodes not up in {timeout_s:.0f} s")
            time.sleep(1.0)

    def stop(self) -> None:
        for p in reversed(self.procs):  # workers first, then the head
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait()
        self.procs = []
        shutil.rmtree(self.temp, ignore_errors=True)
