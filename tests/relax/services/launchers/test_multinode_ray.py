"""A Ray cluster of three nodes on this host, each a ``ray start --block`` process group of its
own: the head holds the custom resource ``trainer_node``, two workers ``rollout_node`` each. A
disaggregated run with ``rollout.engine_resources=rollout_node=1`` places its two engine actors
one on each worker and none on the head, and a launch the cluster's ``rollout_node`` cannot
hold is refused whole. ``parse_resources``, which reads that setting, is tested without Ray.

Nothing here calls ``ray.init`` in the pytest process (it has the session's own cluster, see
``tests/conftest.py``): drivers that look at the three-node cluster are subprocesses, and the
nodes are ended by signalling their process groups, never by ``ray stop`` (which would end
every Ray cluster on the host, other sessions' included).
"""

from __future__ import annotations

import ipaddress
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from relax.config.rollout import parse_resources
from tests.polling import wait_until

RAY = str(Path(sys.executable).with_name("ray"))  # the venv's CLI, beside its python
NODE_PORTS = ("--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
              "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")

# Run as `python -c DRIVER MODE ADDRESS` against the three-node cluster; prints one JSON line.
# The actor table is read from the GCS (ray._private.state): ray.util.state needs the dashboard,
# which these nodes do not run, and the GCS keeps dead actors with the node they ran on.
DRIVER = r"""
import json, sys, time
import ray
from ray._private import state

mode, address = sys.argv[1], sys.argv[2]
ray.init(address=address, log_to_driver=False)
out = {}
if mode == "nodes":  # wait until all three nodes have joined
    deadline = time.monotonic() + 90
    while len([n for n in ray.nodes() if n["Alive"]]) < 3 and time.monotonic() < deadline:
        time.sleep(0.5)
    out = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
else:
    from relax.services.launchers.process import CapacityError
    from relax.services.launchers.ray_actors import RayEngineLauncher

    def engine_actors():
        return [{"node": a["Address"]["NodeID"], "state": a["State"]} for a in state.actors().values()
                if a["ActorClassName"] == "EngineActor"]

    # the run's actors are killed at its end; Ray gives their resources back asynchronously
    deadline = time.monotonic() + 30
    while ray.available_resources().get("rollout_node", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    out["engines"] = engine_actors()
    out["refusals"] = []
    # 5 rollout_node for one engine, and 3 engines of 1 each: each engine of the second fits a node
    for resources, n in (("rollout_node=5", 1), ("rollout_node=1", 3)):
        launcher = RayEngineLauncher("/nonexistent-model", max_engines=8, num_cpus=0.5, resources=resources)
        try:
            launcher.launch(n)
            out["refusals"].append(None)
        except CapacityError as e:
            out["refusals"].append(str(e))
    out["engines_after"] = len(engine_actors())  # a refused launch creates no actor
print("RESULT " + json.dumps(out))
"""


def _free_ports(n: int) -> list[int]:
    socks = []
    try:
        for _ in range(n):  # all held at once, so the n are distinct
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _driver(mode: str, address: str, env: dict[str, str], timeout: float) -> dict:
    proc = subprocess.run([sys.executable, "-c", DRIVER, mode, address], env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def _start_node(temp_root: Path, log_dir: Path, name: str, resources: dict[str, float], env: dict[str, str],
                head: str | None = None, head_ports: tuple[int, int] | None = None) -> tuple[subprocess.Popen, int]:
    """The node's ``ray start --block`` process and its raylet's (node manager's) port."""
    ports = _free_ports(len(NODE_PORTS))
    args = [RAY, "start", "--block", "--node-ip-address=127.0.0.1", "--num-cpus=1", "--num-gpus=0",
            f"--object-store-memory={90 * 1024 * 1024}", f"--resources={json.dumps(resources)}",
            f"--temp-dir={temp_root / name}", "--disable-usage-stats",
            # random worker ports and explicit free ports for every node service: the defaults
            # (10002-19999, 52365, ...) would collide between nodes and with other clusters here
            "--min-worker-port=0", "--max-worker-port=0",
            *(f"{flag}={port}" for flag, port in zip(NODE_PORTS, ports, strict=True))]
    if head is None:
        gcs, client = head_ports
        args += ["--head", f"--port={gcs}", f"--ray-client-server-port={client}", "--include-dashboard=false"]
    else:
        args += [f"--address={head}", "--include-log-monitor=false"]  # one log monitor per host is enough
    log = open(log_dir / f"ray-{name}.log", "wb")  # the child gets its own copy of the descriptor
    try:
        # its own session: the whole node (raylet, GCS, agents, workers) is one process group
        return subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), ports[0]
    finally:
        log.close()


def _wait_port(port: int, node: subprocess.Popen, log: Path, timeout: float = 60.0) -> None:
    def listening() -> bool:
        assert node.poll() is None, log.read_text()[-3000:]
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            return False

    wait_until(listening, timeout, interval=0.3, what=lambda: log.read_text()[-3000:])


def _stop_nodes(nodes: list[subprocess.Popen], temp_root: Path) -> list[int]:
    """SIGTERM each node's process group, SIGKILL what is left after a grace period; returns the
    pids of processes that still named this cluster's temp dir after both (then killed)."""
    for node in nodes:
        try:
            os.killpg(node.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + 15
    for node in nodes:
        try:
            node.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(node.pid, signal.SIGKILL)  # stragglers of the group (workers, agents)
        except ProcessLookupError:
            pass
        node.wait()
    time.sleep(0.5)
    # a process that left the group (setsid) still names the session dir on its command line
    strays = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if str(temp_root).encode() in cmdline and int(pid) != os.getpid():
            strays.append(int(pid))
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    return strays


TINY_RUN = ("data.tasks=[arithmetic]", "data.train_per_task=64", "data.eval_per_task=8", "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4", "rollout.max_new_tokens=8", "trainer.total_steps=3",
            "trainer.checkpoint_every=3", "rollout.engine_launcher=ray", "rollout.engine_cpus=0.5",
            "rollout.engine_resources=rollout_node=1")


class Cluster:
    """Ray nodes started by a test (:meth:`add`; the first is the head), all of whose processes see
    ``env``; :meth:`stop` ends them and returns the processes that outlived their group."""

    def __init__(self, tmp_path: Path, **env_vars: str):
        self.tmp_path = tmp_path
        # Ray puts sockets under --temp-dir and caps their path length: a short folder, not tmp_path
        self.temp_root = Path(tempfile.mkdtemp(prefix="rmn-", dir="/tmp"))
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        # a node drains for up to 30 s on SIGTERM before it stops its processes: nothing to drain here
        self.env.update(RAY_USAGE_STATS_ENABLED="0", RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0", **env_vars)
        self.env.pop("RELAX_FAULT", None)
        self.ports = _free_ports(2)
        self.head = f"127.0.0.1:{self.ports[0]}"
        self.nodes: list[subprocess.Popen] = []

    def add(self, name: str, resources: dict[str, float]) -> None:
        """Start a node and wait until it serves (the head's GCS, a worker's raylet), one at a time: two
        raylets starting at once on a loaded 2-core machine were seen to lose their registration."""
        log = self.tmp_path / f"ray-{name}.log"
        if self.nodes:
            node, raylet = _start_node(self.temp_root, self.tmp_path, name, resources, self.env, head=self.head)
            self.nodes.append(node)
            _wait_port(raylet, node, log)
            return
        node, _ = _start_node(self.temp_root, self.tmp_path, name, resources, self.env, head_ports=tuple(self.ports))
        self.nodes.append(node)
        _wait_port(self.ports[0], node, log)

    def train(self, root: str, run_id: str, *overrides: str) -> None:
        """``relax train`` of a tiny run on this cluster, its engines on ``rollout_node`` nodes."""
        run = subprocess.run([sys.executable, "-m", "relax.cli.main", "train", "tiny-cpu", f"root={root}",
                              f"run_id={run_id}", *TINY_RUN, *overrides, "--no-progress"],
                             env={**self.env, "RAY_ADDRESS": self.head}, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]

    def stop(self) -> list[int]:
        strays = _stop_nodes(self.nodes, self.temp_root)
        shutil.rmtree(self.temp_root, ignore_errors=True)
        return strays


@pytest.mark.slow
@pytest.mark.ray
def test_engines_run_on_the_nodes_holding_their_custom_resource(tmp_path):
    cluster = Cluster(tmp_path)
    head, env = cluster.head, cluster.env
    try:
        cluster.add("head", {"trainer_node": 1})
        for name in ("a", "b"):
            cluster.add(name, {"rollout_node": 1})
        resources = _driver("nodes", head, env, timeout=120)
        assert len(resources) == 3, (resources, [(tmp_path / f"ray-{n}.log").read_text()[-2000:] for n in "ab"])
        [head_id] = [i for i, r in resources.items() if r.get("trainer_node")]
        workers = {i for i, r in resources.items() if r.get("rollout_node")}
        assert len(workers) == 2 and head_id not in workers

        root = f"file://{tmp_path}/root"
        cluster.train(root, "mn", "topology=disaggregated", "rollout.engine_processes=2")
        from relax.services.report.metrics import read_metrics

        assert [m["step"] for m in read_metrics(f"{root}/runs/mn", "actor")] == [0, 1, 2]

        seen = _driver("check", head, env, timeout=120)
        engines = seen["engines"]
        # one engine per worker (each holds the worker's only rollout_node), none on the head
        assert len(engines) >= 2 and {e["node"] for e in engines} == workers, (engines, workers, head_id)
        assert all(e["state"] == "DEAD" for e in engines)  # stopped with the run
        too_big, too_many = seen["refusals"]
        assert too_big is not None and "need 5 rollout_node (5 each) and the Ray cluster has 2 free" in too_big
        assert too_many is not None and "need 3 rollout_node (1 each) and the Ray cluster has 2 free" in too_many
        assert seen["engines_after"] == len(engines)  # refused whole: no actor was created
    finally:
        strays = cluster.stop()
    assert strays == [], f"processes outlived their node's process group: {strays}"


@pytest.mark.slow
@pytest.mark.ray
def test_the_rollout_runs_its_sglang_servers_as_ray_actors(tmp_path):
    # rollout.engine=sglang with engine_launcher=ray: each server is the child of a Ray actor on the node
    # Ray placed it (the SGLang stand-in here, which records its flags), routed to and reloaded like any engine
    argv_dir = tmp_path / "argv"
    argv_dir.mkdir()
    root = f"file://{tmp_path}/root"
    cluster = Cluster(tmp_path, RELAX_STANDIN_ARGV_DIR=str(argv_dir), RELAX_STANDIN_STORE=f"{root}|sg")
    try:
        cluster.add("head", {"rollout_node": 2})
        cluster.train(root, "sg", "rollout.engine=sglang", "rollout.num_engines=2",
                      "rollout.sglang_module=tests.relax.engines.sglang.stand_in_server")
        from relax.services.report.metrics import read_metrics

        rollout = read_metrics(f"{root}/runs/sg", "rollout")
        assert [m["step"] for m in read_metrics(f"{root}/runs/sg", "actor")] == [0, 1, 2]
        assert max(m["weight_version"] for m in rollout) >= 1  # a version reloaded from the store
        launched = [json.loads(p.read_text())["argv"] for p in sorted(argv_dir.iterdir())]
        assert len(launched) == 2  # one server per actor, none replaced
        hosts = {argv[argv.index("--host") + 1] for argv in launched}
        assert len(hosts) == 1 and ipaddress.ip_address(hosts.pop())  # the node's address, as Ray reports it
        assert all("--api-key" in argv and "--tp-size" in argv for argv in launched)
    finally:
        strays = cluster.stop()
    assert strays == [], f"processes outlived their node's process group: {strays}"


class TestParseResources:
    def test_pairs_become_amounts(self):
        assert parse_resources("rollout_node=1") == {"rollout_node": 1.0}
        assert parse_resources(" rollout_node = 2 , accel_x=0.25") == {"rollout_node": 2.0, "accel_x": 0.25}
        assert parse_resources("") == {} and parse_resources("  ") == {}

    @pytest.mark.parametrize("text, bad, why", [
        ("rollout_node", "'rollout_node'", "expected name=amount pairs"),
        ("rollout_node=1,", "''", "expected name=amount pairs"),
        ("=1", "'=1'", "expected name=amount pairs"),
        ("my node=1", "'my node=1'", "expected name=amount pairs"),
        ("a=1=2", "'a=1=2'", "expected name=amount pairs"),
        ("CPU=1", "'CPU=1'", "rollout.engine_cpus"),
        ("a=1,gpu=1", "'gpu=1'", "rollout.engine_gpus"),
        ("memory=100", "'memory=100'", "built-in Ray resource"),
        ("a=1,a=2", "'a=2'", "given twice"),
        ("a=0", "'a=0'", "number >= 0.0001"),
        ("a=-1", "'a=-1'", "number >= 0.0001"),
        ("a=0.00001", "'a=0.00001'", "number >= 0.0001"),
        ("a=lots", "'a=lots'", "number >= 0.0001"),
        ("a=nan", "'a=nan'", "number >= 0.0001"),
        ("a=inf", "'a=inf'", "number >= 0.0001"),
    ])
    def test_bad_input_names_the_pair_and_the_form(self, text, bad, why):
        with pytest.raises(ValueError) as e:
            parse_resources(text)
        msg = str(e.value)
        assert f"bad resource {bad}" in msg and why in msg
        assert "expected name=amount pairs joined by commas" in msg and "positive number" in msg
