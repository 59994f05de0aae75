"""Executes registered workflows node by node, as Flyte's propeller does, minus Kubernetes.

Every task node is a pod-process: the task container's own command (``pyflyte-execute`` with the
task's resolver) with propeller's templates filled in, its inputs and outputs as protobuf literal
maps under the execution's object-store prefix, and nothing shared with other nodes but that store.
A node starts as soon as its upstream nodes are done, so independent nodes (the two role groups)
run at the same time. A dynamic task's pod writes ``futures.pb`` instead of outputs: its nodes run
the same way and its outputs are bound from theirs. A failed attempt (an error document, or a pod
that died) is re-executed up to the task's ``retries``; a cached task (``discoverable``) whose key is
in the catalog is not executed; a Ray task gets a Ray cluster of its own for each attempt
(infra/cluster/ray_cluster.py), torn down after it.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from flyteidl.core import dynamic_job_pb2, errors_pb2, literals_pb2
from google.protobuf.json_format import MessageToDict

from infra.cluster.flyte_objects import (
    Package,
    cache_key,
    exists,
    get_proto,
    put_proto,
    resolve_attr_path,
    substitute,
)
from infra.cluster.ray_cluster import RayCluster

START = ("", "start-node")  # how a binding names the workflow's own inputs


class NodeFailed(RuntimeError):
    pass


@dataclass
class NodeRecord:
    """One task node of one execution, as the summary reports it."""

    name: str  # "<execution>/<node path>:<task>"
    task: str
    pids: list[int] = field(default_factory=list)
    attempts: int = 0
    status: str = "running"  # succeeded | failed | cached
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0  # from the first attempt's start to the node's end, cluster start-ups included


@dataclass
class KillPlan:
    """SIGKILL the pod of the first attempt of task ``task`` once ``when()`` holds (a pod lost mid-run)."""

    task: str
    when: Callable[[], bool]
    done: bool = False


class Propeller:
    def __init__(self, pkg: Package, store: str, workdir: Path, env: dict[str, str], log_dir: Path,
                 kills: list[KillPlan] | None = None, poll_s: float = 1.0):
        self.pkg, self.store, self.workdir, self.env, self.log_dir = pkg, store.rstrip("/"), workdir, env, log_dir
        self.catalog = f"{self.store}/catalog"
        self.kills = kills or []
        self.poll_s = poll_s
        self.records: list[NodeRecord] = []
        self._lock = threading.Lock()
        # each pod's own /tmp (flytekit's sandbox, its downloads): a pod's filesystem is its own
        self.pod_tmp = Path(tempfile.mkdtemp(prefix="relax-pods-"))
        self._pods = itertools.count()
        self._abort = threading.Event()

    # --- workflows -----------------------------------------------------------------------------
    def launch(self, name: str, execution: str, inputs: dict[str, literals_pb2.Literal]) -> literals_pb2.LiteralMap:
        """Execute launch plan ``name`` (a workflow's default plan has its name) with ``inputs``
        over its defaults and fixed inputs, as an execution named ``execution``."""
        lp = self.pkg.launch_plans[name]
        values = {k: p.default for k, p in lp.default_inputs.parameters.items() if p.HasField("default")}
        values.update(inputs)
        values.update(lp.fixed_inputs.literals)
        spec = self.pkg.workflows[lp.workflow_id.name]
        self._abort.clear()
        return self.run_workflow(spec.template, spec, literals_pb2.LiteralMap(literals=values), execution)

    def run_workflow(self, template, spec, inputs: literals_pb2.LiteralMap, path: str,
                     tasks: dict | None = None) -> literals_pb2.LiteralMap:
        outs = self.run_nodes(list(template.nodes), inputs, path, spec, tasks or {})
        return literals_pb2.LiteralMap(literals={b.var: self.bind(b.binding, outs, inputs) for b in template.outputs})

    def run_nodes(self, nodes, inputs, path: str, spec, tasks: dict) -> dict[str, literals_pb2.LiteralMap]:
        outs: dict[str, literals_pb2.LiteralMap] = {}
        pending = {n.id: n for n in nodes}
        running: dict[Future, str] = {}
        with ThreadPoolExecutor(max_workers=max(1, len(nodes))) as pool:
            while pending or running:
                for nid, node in list(pending.items()):
                    if all(u in outs for u in node.upstream_node_ids):
                        node_inputs = literals_pb2.LiteralMap(
                            literals={b.var: self.bind(b.binding, outs, inputs) for b in node.inputs})
                        running[pool.submit(self.run_node, node, node_inputs, f"{path}/{nid}", spec, tasks)] = nid
                        del pending[nid]
                if not running:
                    raise NodeFailed(f"{path}: nodes {sorted(pending)} wait on nodes that do not exist")
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for fut in done:
                    nid = running.pop(fut)
                    try:
                        outs[nid] = fut.result()
                    except BaseException:
                        self._abort.set()  # a failed node fails the workflow: its siblings' pods are stopped
                        for other in running:
                            other.exception()
                        raise
        return outs

    def bind(self, bd, outs: dict[str, literals_pb2.LiteralMap], inputs: literals_pb2.LiteralMap):
        kind = bd.WhichOneof("value")
        if kind == "scalar":
            return literals_pb2.Literal(scalar=bd.scalar)
        if kind == "collection":
            return literals_pb2.Literal(collection=literals_pb2.LiteralCollection(
                literals=[self.bind(b, outs, inputs) for b in bd.collection.bindings]))
        if kind == "map":
            return literals_pb2.Literal(map=literals_pb2.LiteralMap(
                literals={k: self.bind(b, outs, inputs) for k, b in bd.map.bindings.items()}))
        if kind == "promise":
            p = bd.promise
            source = inputs if p.node_id in START else outs[p.node_id]
            return resolve_attr_path(source.literals[p.var], p.attr_path)
        raise NodeFailed(f"binding of kind {kind!r} is not supported by the emulator")

    def run_node(self, node, inputs, path: str, spec, tasks: dict) -> literals_pb2.LiteralMap:
        target = node.WhichOneof("target")
        if target == "task_node":
            name = node.task_node.reference_id.name
            return self.run_task(tasks.get(name) or self.pkg.tasks[name], inputs, path)
        if target == "workflow_node":
            ref = node.workflow_node.sub_workflow_ref.name
            sub = self.pkg.sub_workflow(spec, ref)
            return self.run_workflow(sub, spec, inputs, path, tasks)
        raise NodeFailed(f"{path}: node kind {target!r} is not supported by the emulator")

    # --- tasks (pods) --------------------------------------------------------------------------
    def run_task(self, tmpl, inputs: literals_pb2.LiteralMap, path: str) -> literals_pb2.LiteralMap:
        short = tmpl.id.name.rsplit(".", 1)[-1]
        rec = NodeRecord(f"{path}:{short}", tmpl.id.name)
        with self._lock:
            self.records.append(rec)
        started = time.monotonic()
        try:
            return self._run_task(tmpl, inputs, path, rec)
        finally:
            rec.seconds = round(time.monotonic() - started, 1)

    def _run_task(self, tmpl, inputs, path: str, rec: NodeRecord) -> literals_pb2.LiteralMap:
        key = cache_key(tmpl, inputs) if tmpl.metadata.discoverable else None
        if key and exists(f"{self.catalog}/{key}/outputs.pb"):
            rec.status = "cached"
            return get_proto(f"{self.catalog}/{key}/outputs.pb", literals_pb2.LiteralMap)
        for attempt in range(tmpl.metadata.retries.retries + 1):
            rec.attempts = attempt + 1
            prefix = f"{self.store}/data/{path}/{attempt}"
            outputs = self._attempt(tmpl, inputs, path, prefix, attempt, rec)
            if outputs is not None:
                if key:
                    put_proto(f"{self.catalog}/{key}/outputs.pb", outputs)
                rec.status = "succeeded"
                return outputs
            if self._abort.is_set():
                break
        rec.status = "failed"
        raise NodeFailed(f"{rec.name} failed after {rec.attempts} attempt(s): {rec.errors[-1] if rec.errors else ''}")

    def _attempt(self, tmpl, inputs, path: str, prefix: str, attempt: int, rec: NodeRecord):
        put_proto(f"{prefix}/inputs.pb", inputs)
        log = self.log_dir / f"{path.replace('/', '.')}.{attempt}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        cluster = None
        tmp = self.pod_tmp / str(next(self._pods))
        tmp.mkdir()
        env = {**self.env, **{e.key: e.value for e in tmpl.container.env}, "FLYTE_ATTEMPT_NUMBER": str(attempt),
               "TMPDIR": str(tmp),
               "FLYTE_INTERNAL_EXECUTION_ID": path.split("/", 1)[0], "FLYTE_INTERNAL_EXECUTION_PROJECT": "relax",
               "FLYTE_INTERNAL_EXECUTION_DOMAIN": "development", "FLYTE_INTERNAL_TASK_NAME": tmpl.id.name,
               "FLYTE_INTERNAL_TASK_PROJECT": "relax", "FLYTE_INTERNAL_TASK_DOMAIN": "development",
               "FLYTE_INTERNAL_TASK_VERSION": tmpl.id.version or "emulated"}
        try:
            if tmpl.type == "ray":
                spec = MessageToDict(tmpl.custom)["rayCluster"]
                cluster = RayCluster(spec, self.log_dir / f"{path.replace('/', '.')}.{attempt}.ray")
                env["RAY_ADDRESS"] = cluster.address
            args = substitute(list(tmpl.container.args), prefix, f"{self.store}/raw/{path}/{attempt}")
            with open(log, "wb") as out:
                proc = subprocess.Popen(args, cwd=self.workdir, env=env, stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True)
            rec.pids.append(proc.pid)
            self._wait(proc, tmpl.id.name, attempt)
        except (RuntimeError, TimeoutError) as e:  # a Ray cluster that did not come up: a failed attempt
            rec.errors.append(str(e))
            return None
        finally:
            if cluster is not None:
                cluster.stop()
        if exists(f"{prefix}/outputs.pb"):
            return get_proto(f"{prefix}/outputs.pb", literals_pb2.LiteralMap)
        if exists(f"{prefix}/futures.pb"):
            job = get_proto(f"{prefix}/futures.pb", dynamic_job_pb2.DynamicJobSpec)
            tasks = {t.id.name: t for t in job.tasks}
            outs = self.run_nodes(list(job.nodes), inputs, f"{path}/dyn", None, tasks)
            return literals_pb2.LiteralMap(literals={b.var: self.bind(b.binding, outs, inputs) for b in job.outputs})
        if exists(f"{prefix}/error.pb"):
            err = get_proto(f"{prefix}/error.pb", errors_pb2.ErrorDocument).error
            rec.errors.append(f"{err.code}: {err.message.strip()[-2000:]}")
        else:
            rec.errors.append(f"pod exited with {proc.returncode} and wrote no outputs (log: {log})")
        return None

    def _wait(self, proc: subprocess.Popen, task: str, attempt: int) -> None:
        plans = [k for k in self.kills if k.task == task and not k.done and attempt == 0]
        while proc.poll() is None:
            if self._abort.is_set():
                os.killpg(proc.pid, signal.SIGKILL)
            for plan in plans:
                if not plan.done and plan.when():
                    plan.done = True
                    os.killpg(proc.pid, signal.SIGKILL)  # the pod is lost with everything in it
            time.sleep(self.poll_s)

    def close(self) -> None:
        """Remove the pods' /tmp folders (their logs stay under the log folder)."""
        shutil.rmtree(self.pod_tmp, ignore_errors=True)

    def summary(self) -> list[dict]:
        return [{"name": r.name, "pids": r.pids, "attempts": r.attempts, "status": r.status, "seconds": r.seconds}
                for r in self.records]

    def dump(self, path: Path) -> None:
        path.write_text(json.dumps([r.__dict__ for r in self.records], indent=1))
