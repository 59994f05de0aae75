"""What the emulator reads and writes as Flyte does: the registered entities (``pyflyte package``
protobufs), and the literal maps every node exchanges through the object store.

Nothing here imports relax: the entities are read back from the same protobufs a Flyte admin
would be given, and literals are handled at the protobuf level as propeller handles them.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tarfile
from dataclasses import dataclass, field
from pathlib import Path

import fsspec
import msgpack
from flyteidl.admin import launch_plan_pb2, task_pb2, workflow_pb2
from flyteidl.core import literals_pb2, tasks_pb2
from flyteidl.core import workflow_pb2 as core_workflow_pb2


@dataclass
class Package:
    """The entities of one ``pyflyte package``, by name (``tasks.train.train``, ``omni_rl_nightly``)."""

    tasks: dict[str, tasks_pb2.TaskTemplate] = field(default_factory=dict)
    workflows: dict[str, workflow_pb2.WorkflowSpec] = field(default_factory=dict)
    launch_plans: dict[str, launch_plan_pb2.LaunchPlanSpec] = field(default_factory=dict)

    def sub_workflow(self, spec: workflow_pb2.WorkflowSpec, name: str) -> core_workflow_pb2.WorkflowTemplate:
        for sub in spec.sub_workflows:
            if sub.id.name == name:
                return sub
        return self.workflows[name].template


def package(repo: Path, out_dir: Path, env: dict[str, str], image: str = "relax:dev") -> Package:
    """``pyflyte --pkgs workflows package`` as a user registers, read back from the tgz it writes."""
    out = out_dir / "flyte-package.tgz"
    pyflyte = str(Path(sys.executable).with_name("pyflyte"))
    done = subprocess.run([pyflyte, "--pkgs", "workflows", "package", "--image", image, "--output", str(out),
                           "--force"], cwd=repo, capture_output=True, text=True, timeout=300, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"pyflyte package failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    pkg = Package()
    with tarfile.open(out) as tar:
        for member in tar.getmembers():
            if not member.name.endswith(".pb"):
                continue
            data = tar.extractfile(member).read()
            kind = member.name.rsplit("_", 1)[1][:-3]  # <n>_<name>_<kind>.pb: 1 task, 2 workflow, 3 launch plan
            if kind == "1":
                spec = task_pb2.TaskSpec.FromString(data)
                pkg.tasks[spec.template.id.name] = spec.template
            elif kind == "2":
                wf = workflow_pb2.WorkflowSpec.FromString(data)
                pkg.workflows[wf.template.id.name] = wf
            else:
                lp = launch_plan_pb2.LaunchPlan.FromString(data)
                pkg.launch_plans[lp.id.name] = lp.spec
    return pkg


def _fs(url: str):
    return fsspec.core.url_to_fs(url, use_listings_cache=False)


def put_proto(url: str, message) -> None:
    fs, path = _fs(url)
    fs.pipe_file(path, message.SerializeToString(deterministic=True))


def get_proto(url: str, cls):
    fs, path = _fs(url)
    return cls.FromString(fs.cat_file(path))


def exists(url: str) -> bool:
    fs, path = _fs(url)
    return fs.exists(path)


def _to_literal(value) -> literals_pb2.Literal:
    """A value read out of a msgpack dataclass by an attribute path, as propeller turns it back into a literal."""
    scalar = literals_pb2.Scalar
    if isinstance(value, bool):
        return literals_pb2.Literal(scalar=scalar(primitive=literals_pb2.Primitive(boolean=value)))
    if isinstance(value, int):
        return literals_pb2.Literal(scalar=scalar(primitive=literals_pb2.Primitive(integer=value)))
    if isinstance(value, float):
        return literals_pb2.Literal(scalar=scalar(primitive=literals_pb2.Primitive(float_value=value)))
    if isinstance(value, str):
        return literals_pb2.Literal(scalar=scalar(primitive=literals_pb2.Primitive(string_value=value)))
    return literals_pb2.Literal(scalar=scalar(binary=literals_pb2.Binary(value=msgpack.packb(value), tag="msgpack")))


def resolve_attr_path(lit: literals_pb2.Literal, path) -> literals_pb2.Literal:
    """``promise.attr_path`` on a dataclass output (``summary.checkpoint``, ``cfg.data``)."""
    if not path:
        return lit
    if not lit.scalar.HasField("binary"):
        raise ValueError(
            f"attribute path {[p.string_value for p in path]} on a literal that is not a msgpack dataclass"
        )
    value = msgpack.unpackb(lit.scalar.binary.value)
    for step in path:
        value = value[step.string_value] if step.HasField("string_value") else value[step.int_value]
    return _to_literal(value)


def cache_key(task: tasks_pb2.TaskTemplate, inputs: literals_pb2.LiteralMap) -> str:
    """The data catalog's key of a cached task: its name, its cache version, and its inputs' content
    (a literal's ``hash`` where the SDK set one, as Flyte does)."""
    h = hashlib.sha256(f"{task.id.name}\0{task.metadata.discovery_version}\0".encode())
    for name in sorted(inputs.literals):
        lit = inputs.literals[name]
        h.update(name.encode() + b"\0" + (lit.hash.encode() if lit.hash else lit.SerializeToString(deterministic=True)))
    return h.hexdigest()[:32]


def substitute(args: list[str], prefix: str, raw: str) -> list[str]:
    """A task container's arguments with propeller's templates filled in for one attempt."""
    values = {"{{.input}}": f"{prefix}/inputs.pb", "{{.outputPrefix}}": prefix, "{{.rawOutputDataPrefix}}": raw,
              "{{.checkpointOutputPrefix}}": f"{prefix}/_checkpoint", "{{.prevCheckpointPrefix}}": '""'}
    out = []
    for a in args:
        for k, v in values.items():
            a = a.replace(k, v)
        out.append(a)
    return out


def storage_env(endpoint: str, key: str, secret: str) -> dict[str, str]:
    """How a pod reaches the object store: flytekit's variables and botocore's (which relax uses)."""
    return {"FLYTE_AWS_ENDPOINT": endpoint, "FLYTE_AWS_ACCESS_KEY_ID": key, "FLYTE_AWS_SECRET_ACCESS_KEY": secret,
            "AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": key, "AWS_SECRET_ACCESS_KEY": secret,
            "PYTHONUNBUFFERED": "1",
            # the image's PATH starts with its venv (infra/Dockerfile): pyflyte-execute is found there
            "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])}
