"""The train tasks: Ray cluster specs derived from the config, and what the dynamic `train` task
launches on a cluster (compiled the way a Flyte pod compiles it, with no cluster needed)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import msgpack
import pytest
from flytekit.configuration import Image, ImageConfig, SerializationSettings
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from flytekit.core.type_engine import TypeEngine

from relax.config import ConfigError, RelaxConfig, ResourcesConfig, load_config
from tasks import train as train_tasks
from tasks.train import cluster_resources, group_gpus, ray_job_config, role_cpus, role_gpus, run_role_group

SETTINGS = SerializationSettings(project="relax", domain="development", version="v1",
                                 image_config=ImageConfig(default_image=Image(name="default", fqn="relax", tag="dev")))


def test_ray_job_config_sizes_head_and_workers():
    res = ResourcesConfig(num_cpus=8, num_gpus=8, workers=3, cpus_per_worker=16, gpus_per_worker=2, memory_gib=32)
    job = ray_job_config(res)
    head, (worker,) = job.head_node_config, job.worker_node_config
    assert head.ray_start_params == {"num-cpus": "8", "num-gpus": "2"}  # 8 GPUs - 3 workers x 2
    assert (head.requests.cpu, head.requests.mem, head.requests.gpu) == ("8", "32Gi", "2")
    assert (worker.group_name, worker.replicas, worker.requests.gpu, worker.limits.cpu) == ("workers", 3, "2", "16")
    # more worker GPUs than the total: the head gets none rather than a negative count
    assert (
        ray_job_config(ResourcesConfig(num_gpus=1, workers=2, gpus_per_worker=1)).head_node_config.requests.gpu is None
    )


def test_role_groups_split_the_gpus():
    res = ResourcesConfig(num_gpus=4, rollout_gpus=1, actor_gpus=3)
    assert (group_gpus(res, "rollout"), group_gpus(res, "learner"), group_gpus(res, "workers")) == (1, 3, 4)
    even = ResourcesConfig(num_gpus=5)  # no role split given: rollout half, learner the rest
    assert (group_gpus(even, "rollout"), group_gpus(even, "learner")) == (2, 3)
    assert (role_gpus(res, "rollout"), role_gpus(res, "actor"), role_gpus(res, "advantage")) == (1, 3, 0)
    # 3 learner GPUs on 1-GPU workers: one node never has more than 1, so the actor asks for 1
    spread = ResourcesConfig(num_gpus=4, rollout_gpus=1, actor_gpus=3, workers=3, gpus_per_worker=1)
    assert role_gpus(spread, "actor") == 1


def test_role_hosts_ask_for_a_cpu_share_that_fits_node_by_node():
    # 4 roles on a 2-CPU head and a 1-CPU worker: a share of 3/4 fits twice on the head and once on the
    # worker (3 < 4); 2/3 fits 3 + 1 = 4 times, rounded down to Ray's 1e-4 so 3 x 0.6666 <= 2 really holds
    assert role_cpus(ResourcesConfig(num_cpus=2, workers=1, cpus_per_worker=1), 4) == 0.6666
    assert role_cpus(ResourcesConfig(num_cpus=2), 3) == 0.6666  # one node: 2 CPUs / 3 roles
    assert role_cpus(ResourcesConfig(num_cpus=8), 3) == 1.0  # room for a whole CPU each
    assert role_cpus(ResourcesConfig(num_cpus=1, workers=2, cpus_per_worker=1), 3) == 1.0  # one per node


def test_cluster_resources_come_from_the_named_preset(monkeypatch):
    monkeypatch.setenv("RELAX_CLUSTER_CONFIG", "qwen2.5-omni-3b")
    assert cluster_resources() == load_config("qwen2.5-omni-3b").resources
    monkeypatch.delenv("RELAX_CLUSTER_CONFIG")
    assert cluster_resources() == RelaxConfig().resources


def test_without_a_cluster_config_the_package_asks_for_the_tiny_cluster(monkeypatch):
    # what `pyflyte package` serializes with RELAX_CLUSTER_CONFIG unset (tests/workflows/test_package.py
    # packages a configured cluster): a 2-CPU head, no GPU, no workers
    monkeypatch.delenv("RELAX_CLUSTER_CONFIG", raising=False)
    job = ray_job_config(cluster_resources())
    head, (worker,) = job.head_node_config, job.worker_node_config
    assert (head.requests.cpu, head.requests.mem, head.requests.gpu) == ("2", "8Gi", None)
    assert head.ray_start_params == {"num-cpus": "2", "num-gpus": "0"}
    assert (worker.group_name, worker.replicas) == ("workers", 0)


def compile_train(cfg: RelaxConfig, init_checkpoint: str):
    """What `train` hands Flyte on a cluster: a DynamicJobSpec (nodes + the task templates they run)."""
    train_tasks.train._wf = None  # flytekit compiles a dynamic once per process (a pod runs one); start afresh
    ctx = FlyteContextManager.current_context()
    with FlyteContextManager.with_context(ctx.with_serialization_settings(SETTINGS)) as ctx:
        remote = ctx.execution_state.with_params(mode=ExecutionState.Mode.TASK_EXECUTION)
        with FlyteContextManager.with_context(ctx.with_execution_state(remote)) as ctx:
            inputs = TypeEngine.dict_to_literal_map(ctx, {"cfg": cfg, "init_checkpoint": init_checkpoint},
                                                    {"cfg": RelaxConfig, "init_checkpoint": str})
            return train_tasks.train.dispatch_execute(ctx, inputs)


def node_cfg(node) -> dict:
    (binding,) = [b for b in node.inputs if b.var == "cfg"]
    return msgpack.unpackb(binding.binding.scalar.binary.value)


def test_colocated_is_one_ray_task_sized_by_the_runs_config():
    cfg = load_config(None, ["resources.num_cpus=6", "resources.workers=2", "resources.memory_gib=16"])
    spec = compile_train(cfg, "")
    (node,), (tmpl,) = spec.nodes, spec.tasks
    assert node.task_node.reference_id.name == tmpl.id.name == "tasks.train.train_step"  # the registered name
    head = tmpl.custom["rayCluster"]["headGroupSpec"]
    (worker,) = tmpl.custom["rayCluster"]["workerGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "6" and worker["replicas"] == 2  # not the registered defaults
    assert worker["k8sPod"]["podSpec"]["containers"][0]["resources"]["limits"]["memory"] == "16Gi"
    assert train_tasks.train_step.task_config.head_node_config.ray_start_params["num-cpus"] == "2"  # untouched


def test_disaggregated_runs_role_groups_concurrently_between_start_and_finish():
    cfg = load_config(None, ["topology=disaggregated", "resources.num_gpus=4", "resources.rollout_gpus=1",
                             "resources.actor_gpus=3"])
    spec = compile_train(cfg, "s3://bucket/relax/warm_start/abc")
    nodes = {n.task_node.reference_id.name.rsplit(".", 1)[1]: n for n in spec.nodes}
    assert set(nodes) == {"start_run", "rollout_group", "learner_group", "finish_run"}
    ids = {name: n.id for name, n in nodes.items()}
    # the two role groups depend only on the run record, not on each other: a cluster runs them together
    assert nodes["rollout_group"].upstream_node_ids == [ids["start_run"]]
    assert nodes["learner_group"].upstream_node_ids == [ids["start_run"]]
    assert {ids["rollout_group"], ids["learner_group"]} <= set(nodes["finish_run"].upstream_node_ids)
    templates = {t.id.name.rsplit(".", 1)[1]: t for t in spec.tasks}
    for group, gpus in (("rollout_group", "1"), ("learner_group", "3")):
        cluster = templates[group].custom["rayCluster"]
        assert cluster["headGroupSpec"]["rayStartParams"]["num-gpus"] == gpus
        assert cluster["workerGroupSpec"][0]["groupName"] == group.split("_")[0]
    # the roles see only cfg, so the warm-start checkpoint travels in it
    for node in spec.nodes:
        assert node_cfg(node)["model"]["init_checkpoint"] == "s3://bucket/relax/warm_start/abc"


@pytest.mark.parametrize(
    "overrides",
    [
        [],
        ["algorithm.reference_role=true", "algorithm.kl_coef=0.01"],
        ["algorithm.advantage=gae", "model.value_head=true"],
        ["data.reward_role=true"],
        ["algorithm.mode=distill", "algorithm.distill_coef=1", "teacher.name_or_path=tiny-qwen2"],
    ],
)
def test_the_role_groups_start_exactly_the_roles_of_the_run(overrides):
    from relax.services.roles.factory import ROLE_GROUPS, ROLE_NAMES, group_roles, role_names

    assert set(ROLE_GROUPS) == set(ROLE_NAMES)  # a new role must be given a group
    cfg = load_config(None, ["topology=disaggregated", *overrides])
    groups = group_roles(cfg, "rollout") + group_roles(cfg, "learner")
    assert sorted(groups) == sorted(role_names(cfg)) and len(groups) > 3 - (not overrides)
    omni = load_config("omni-cpu")  # the main preset runs a reference role
    assert "reference" in group_roles(omni, "learner")


@pytest.mark.ray
@pytest.mark.slow
def test_role_groups_train_a_run_together(tmp_path, ray_session, monkeypatch):
    """The disaggregated cluster path for real, on the session's Ray: two role groups at once (as two
    Ray tasks would run on a cluster), one role healed by its group's controller, then the summary."""
    from relax.cli.train_cmd import run_status
    from tests.workflows.test_omni_rl import TINY

    cfg = load_config(None, [f"root=file://{tmp_path}/root", "topology=disaggregated", *TINY])
    with pytest.raises(ConfigError, match="sft_steps=2 asks for a format warm-start"):
        train_tasks.start_run(cfg=cfg)  # the roles never warm-start: the workflow passes the warm start in
    cfg = replace(cfg, trainer=replace(cfg.trainer, sft_steps=0))
    run_url = train_tasks.start_run(cfg=cfg)
    monkeypatch.setenv("RELAX_FAULT", "actor:step:0:1")  # the actor dies once, after its first step
    with ThreadPoolExecutor(2) as pool:
        rollout, learner = pool.map(lambda g: run_role_group(g, cfg), ("rollout", "learner"))
    # attempts per role: the group's controller restarted the actor on the Ray cluster, as locally
    assert rollout == {"rollout": 1} and learner == {"advantage": 1, "actor": 2}
    assert run_status(cfg.root, cfg.run_id)["restarts"] == {"actor": 1}
    summary = train_tasks.finish_run(cfg=cfg, run_url=run_url)
    assert summary.steps == 2 and summary.run_url == run_url
    assert summary.checkpoint.endswith("checkpoints/step-000001")


# run in a fresh interpreter: this session's Ray may already be up, and pre_execute leaves a running one alone
_LOCAL_PRE_EXECUTE = """
import ray
from flytekit.core.context_manager import ExecutionState, FlyteContextManager
from tasks.train import RelaxRayTask, learner_group, train_step
assert type(train_step) is RelaxRayTask and type(learner_group) is RelaxRayTask
ctx = FlyteContextManager.current_context()
state = ctx.new_execution_state().with_params(mode=ExecutionState.Mode.LOCAL_TASK_EXECUTION)
with FlyteContextManager.with_context(ctx.with_execution_state(state)):
    train_step.pre_execute(ctx.user_space_params)
print("webui", repr(ray._private.worker._global_node.address_info.get("webui_url")))
ray.shutdown()
"""


@pytest.mark.ray
@pytest.mark.slow  # ~18 s: a Ray cluster started and stopped
def test_a_local_ray_task_starts_ray_without_the_dashboard():
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != train_tasks.DASHBOARD_ENV}
    out = subprocess.run([sys.executable, "-c", _LOCAL_PRE_EXECUTE], capture_output=True, text=True, timeout=300,
                         env={**env, "PYTHONPATH": root}, cwd=root)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "webui ''" in out.stdout  # no dashboard: the plugin's own ray.init() would serve one on :8265
