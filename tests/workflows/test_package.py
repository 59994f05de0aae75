"""`pyflyte package`: what a Flyte cluster would be given, read back from the protobufs in the tgz.

Serialization is offline and takes seconds, so this is the cheap check that the Ray tasks carry the
cluster shape derived from the config, and that the nightly launch plan carries its schedule.
"""

from __future__ import annotations

import base64
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import msgpack
import pytest
import yaml
from flyteidl.admin import launch_plan_pb2, task_pb2
from google.protobuf.json_format import MessageToDict

from relax.config import RelaxConfig, config_to_dict

REPO = Path(__file__).resolve().parents[2]
PYFLYTE = str(Path(sys.executable).with_name("pyflyte"))
pytestmark = pytest.mark.slow  # each package (one per module, one for the default cluster) takes ~18 s
NIGHTLY = {"run_id": "nightly", "root": "s3://bucket/relax"}  # the launch plan's default config
# a 2-node GPU cluster: head 8 CPUs, one worker with 16 CPUs and 1 GPU, 4 GPUs in all
CLUSTER = {"num_cpus": 8, "num_gpus": 4, "rollout_gpus": 2, "actor_gpus": 2, "workers": 1,
           "cpus_per_worker": 16, "gpus_per_worker": 1, "memory_gib": 64}


def package(tmp_path: Path, **env: str) -> dict[str, bytes]:
    """Run `pyflyte package` and return the tgz's files by entity name."""
    out_file = tmp_path / "flyte-package.tgz"
    out = subprocess.run([PYFLYTE, "--pkgs", "workflows", "package", "--image", "relax:dev", "--output",
                          str(out_file), "--force"], cwd=REPO, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "HOME": str(tmp_path / "home"), **env})
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    with tarfile.open(out_file) as tar:
        # names are "<n>_<entity>_<kind>.pb"; kind 1 = task, 2/3 = workflow/launch plan
        return {m.name.split("_", 1)[1].rsplit("_", 1)[0] + "_" + m.name.rsplit("_", 1)[1][:-3]:
                tar.extractfile(m).read() for m in tar.getmembers() if m.name.endswith(".pb")}


def ray_spec(files: dict[str, bytes], name: str) -> dict:
    spec = task_pb2.TaskSpec()
    spec.ParseFromString(files[f"tasks.train.{name}_1"])
    assert spec.template.type == "ray"
    return MessageToDict(spec.template.custom)["rayCluster"]


def pod(group: dict, container: str) -> dict:
    (c,) = group["k8sPod"]["podSpec"]["containers"]
    assert c["name"] == container
    assert c["resources"]["requests"] == c["resources"]["limits"]  # Guaranteed QoS
    return {**c["resources"]["requests"], "start": group["rayStartParams"]}


@pytest.fixture(scope="module")
def cluster_package(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pkg")
    (tmp / "cluster.yaml").write_text(yaml.safe_dump({"resources": CLUSTER}))
    (tmp / "nightly.yaml").write_text(yaml.safe_dump(NIGHTLY))
    return package(tmp, RELAX_CLUSTER_CONFIG=str(tmp / "cluster.yaml"), RELAX_NIGHTLY_CONFIG=str(tmp / "nightly.yaml"))


def test_every_entity_serializes(cluster_package):
    names = set(cluster_package)
    assert {"tasks.data.snapshot_dataset_1", "tasks.train.train_step_1", "tasks.register.register_1",
            "workflows.omni_rl.omni_rl_2", "workflows.nightly.omni_rl_retrain_2", "omni_rl_nightly_3"} <= names


def test_ray_train_task_has_the_configured_cluster(cluster_package):
    spec = ray_spec(cluster_package, "train_step")
    head = pod(spec["headGroupSpec"], "ray-head")
    # the worker holds 1 of the 4 GPUs, the head the other 3
    assert head == {"cpu": "8", "memory": "64Gi", "nvidia.com/gpu": "3", "start": {"num-cpus": "8", "num-gpus": "3"}}
    (worker,) = spec["workerGroupSpec"]
    assert (worker["groupName"], worker["replicas"], worker["minReplicas"], worker["maxReplicas"]) == (
        "workers",
        1,
        1,
        1,
    )
    assert pod(worker, "ray-worker") == {"cpu": "16", "memory": "64Gi", "nvidia.com/gpu": "1",
                                         "start": {"num-cpus": "16", "num-gpus": "1"}}


def test_disaggregated_role_groups_get_their_gpus(cluster_package):
    for name, group in (("rollout_group", "rollout"), ("learner_group", "learner")):
        spec = ray_spec(cluster_package, name)
        (worker,) = spec["workerGroupSpec"]
        assert worker["groupName"] == group
        # 2 GPUs for the group: 1 on its worker, 1 on its head
        assert pod(spec["headGroupSpec"], "ray-head")["nvidia.com/gpu"] == "1"


def test_nightly_launch_plan_schedule_and_defaults(cluster_package):
    lp = launch_plan_pb2.LaunchPlan()
    lp.ParseFromString(cluster_package["omni_rl_nightly_3"])
    spec = MessageToDict(lp.spec)
    assert spec["entityMetadata"]["schedule"] == {"cronSchedule": {"schedule": "0 3 * * *"},
                                                  "kickoffTimeInputArg": "kickoff_time"}
    params = spec["defaultInputs"]["parameters"]
    assert params["kickoff_time"]["required"] is True  # the scheduler fills it
    binary = params["cfg"]["default"]["scalar"]["binary"]  # a dataclass default travels as msgpack
    assert binary["tag"] == "msgpack"
    default = msgpack.unpackb(base64.b64decode(binary["value"]))
    assert default == {**config_to_dict(RelaxConfig()), **NIGHTLY}


def test_register_output_is_the_checkpoint_artifact(cluster_package):
    spec = task_pb2.TaskSpec()
    spec.ParseFromString(cluster_package["tasks.register.register_1"])
    out = MessageToDict(spec.template.interface)["outputs"]["variables"]["checkpoint"]
    assert out["type"]["blob"]["dimensionality"] == "MULTIPART"  # a directory
    artifact = out["artifactPartialId"]
    assert artifact["artifactKey"]["name"] == "relax_checkpoint"
    assert set(artifact["partitions"]["value"]) == {"model", "dataset", "run"}


def _quantity(value: str) -> float:
    """A Kubernetes quantity ("64Gi", "500m", "8") as a number."""
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "m": 1e-3}
    for unit, scale in units.items():
        if str(value).endswith(unit):
            return float(str(value)[:-len(unit)]) * scale
    return float(value)


@pytest.fixture(scope="module")
def infra_package(tmp_path_factory):
    """What `RELAX_CLUSTER_CONFIG=infra/kuberay/cluster.yaml pyflyte register` would register."""
    return package(tmp_path_factory.mktemp("infra"), RELAX_CLUSTER_CONFIG=str(REPO / "infra/kuberay/cluster.yaml"))


def test_the_registered_ray_cluster_is_the_one_in_infra_kuberay(infra_package):
    import ray

    kube = yaml.safe_load((REPO / "infra/kuberay/raycluster.yaml").read_text())["spec"]
    assert kube["rayVersion"] == ray.__version__  # the image's ray, which the emulator and tests run
    spec = ray_spec(infra_package, "train_step")
    for registered, group, container in ((spec["headGroupSpec"], kube["headGroupSpec"], "ray-head"),
                                         (spec["workerGroupSpec"][0], kube["workerGroupSpecs"][0], "ray-worker")):
        (c,) = group["template"]["spec"]["containers"]
        want = {k: str(v) for k, v in c["resources"]["requests"].items()}
        got = pod(registered, container)
        assert {k: _quantity(v) for k, v in got.items() if k != "start"} == {k: _quantity(v) for k, v in want.items()}
        assert got["start"] == {k: group["rayStartParams"][k] for k in ("num-cpus", "num-gpus")}
    (worker,) = spec["workerGroupSpec"]
    assert (worker["groupName"], worker["replicas"]) == (kube["workerGroupSpecs"][0]["groupName"],
                                                        kube["workerGroupSpecs"][0]["replicas"])


def test_every_task_fits_the_projects_limits_and_has_a_plugin(infra_package):
    limits = yaml.safe_load((REPO / "infra/flyte/task-resources.yaml").read_text())["limits"]
    cap = {
        "cpu": _quantity(limits["cpu"]),
        "memory": _quantity(limits["memory"]),
        "nvidia.com/gpu": float(limits["gpu"]),
    }
    values = yaml.safe_load((REPO / "infra/flyte/values-ray.yaml").read_text())["configuration"]["inline"]
    plugins = values["tasks"]["task-plugins"]
    tasks = {k: v for k, v in infra_package.items() if k.endswith("_1")}
    assert len(tasks) >= 10
    for name, data in tasks.items():
        spec = task_pb2.TaskSpec()
        spec.ParseFromString(data)
        t = spec.template
        assert t.container.image == "relax:dev", name  # every pod runs the one registered image
        kind = "container" if t.type == "python-task" else t.type
        assert kind in plugins["default-for-task-types"] and plugins["default-for-task-types"][kind] in \
            plugins["enabled-plugins"], f"{name}: task type {t.type} has no enabled plugin"
        asked = [{r.name: r.value for r in t.container.resources.requests}]
        if t.type == "ray":
            assert t.metadata.retries.retries >= 1, f"{name}: a lost Ray pod must be retried"
            cluster = MessageToDict(t.custom)["rayCluster"]
            asked = [pod(g, c) for g, c in ((cluster["headGroupSpec"], "ray-head"),
                                            *((w, "ray-worker") for w in cluster["workerGroupSpec"]))]
        names = {1: "cpu", 3: "memory", 2: "nvidia.com/gpu"}  # flyteidl's ResourceName enum
        for res in asked:
            for key, value in res.items():
                key = names.get(key, key)
                if key in cap:
                    assert _quantity(value) <= cap[key], f"{name}: {key}={value} over the project's limit"
