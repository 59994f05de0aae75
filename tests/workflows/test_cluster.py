"""The deployed path, executed (infra/cluster_run.py): every Flyte node in a process of its own,
through pyflyte-execute and a local S3 server, each Ray task on a Ray cluster of its own.

The long cases run the emulator as a user would, as a subprocess on the session's S3 server, and
read its JSON summary; the run it made is then checked from the object store with relax's readers.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import msgpack
import pytest
import torch
from flyteidl.core import literals_pb2, tasks_pb2, types_pb2

from infra.cluster.flyte_objects import cache_key, resolve_attr_path, substitute
from infra.cluster.scenario import passed, schedule_ticks

REPO = Path(__file__).resolve().parents[2]


def cluster_run(tmp_path: Path, *args: str) -> tuple[int, dict]:
    out = subprocess.run([sys.executable, str(REPO / "infra" / "cluster_run.py"), "--work", str(tmp_path / "work"),
                          *args], capture_output=True, text=True, timeout=1500, cwd=tmp_path)
    lines = out.stdout.strip().splitlines()
    assert lines, out.stderr[-4000:]
    return out.returncode, json.loads(lines[-1])


def test_the_clock_fires_a_daily_schedule_at_its_next_times():
    after = datetime(2026, 1, 1, 5, 0, tzinfo=timezone.utc)  # past today's 03:00: tomorrow's is the first
    assert schedule_ticks("0 3 * * *", after, 2) == [datetime(2026, 1, 2, 3, 0, tzinfo=timezone.utc),
                                                     datetime(2026, 1, 3, 3, 0, tzinfo=timezone.utc)]
    assert schedule_ticks("30 6 * * *", after, 1) == [datetime(2026, 1, 1, 6, 30, tzinfo=timezone.utc)]
    with pytest.raises(ValueError, match="daily schedules only"):
        schedule_ticks("0 3 * * 1", after, 1)


def test_attribute_paths_and_cache_keys_as_propeller_makes_them():
    summary = {"checkpoint": "s3://b/ckpt", "steps": 4, "nested": {"a": [1, 2]}}
    lit = literals_pb2.Literal(scalar=literals_pb2.Scalar(binary=literals_pb2.Binary(
        value=msgpack.packb(summary), tag="msgpack")))
    step = types_pb2.PromiseAttribute
    assert resolve_attr_path(lit, [step(string_value="checkpoint")]).scalar.primitive.string_value == "s3://b/ckpt"
    assert resolve_attr_path(lit, [step(string_value="steps")]).scalar.primitive.integer == 4
    nested = resolve_attr_path(lit, [step(string_value="nested")])
    assert msgpack.unpackb(nested.scalar.binary.value) == {"a": [1, 2]}  # a dataclass stays msgpack
    task = tasks_pb2.TaskTemplate()
    task.id.name, task.metadata.discovery_version = "tasks.evaluate.evaluate", "3"
    one = literals_pb2.LiteralMap(literals={"checkpoint": lit})
    key = cache_key(task, one)
    assert key == cache_key(task, literals_pb2.LiteralMap(literals={"checkpoint": lit}))  # deterministic
    task.metadata.discovery_version = "4"
    assert cache_key(task, one) != key  # a new cache version misses
    assert substitute(["--inputs", "{{.input}}", "--output-prefix", "{{.outputPrefix}}"], "s3://b/x/0", "s3://b/r") \
        == ["--inputs", "s3://b/x/0/inputs.pb", "--output-prefix", "s3://b/x/0"]


def test_the_exit_criteria_fail_on_each_broken_check():
    good = {"nodes": [{"name": "a", "pids": [1], "status": "succeeded"}, {"name": "b", "pids": [2],
                                                                          "status": "cached"}],
            "runs": {"r": {"role_names": ["actor", "reference"], "roles_started": ["actor", "reference"]}},
            "lost": 0, "doubled": 0, "lineage_chain_ok": True, "registered": {"ok": True}}
    assert passed(good)
    for broken in ({"runs": {"r": {"role_names": ["actor", "reference"], "roles_started": ["actor"]}}},
                   {"lost": 1}, {"doubled": 2}, {"lineage_chain_ok": False}, {"registered": {"ok": False}},
                   {"nodes": [{"name": "a", "pids": [1], "status": "failed"}]},
                   {"nodes": [{"name": "a", "pids": [1], "status": "succeeded"},
                              {"name": "b", "pids": [1], "status": "succeeded"}]}):
        assert not passed({**good, **broken}), broken


def _run_config(root: str, run_id: str):
    from relax import objstore
    from relax.config import config_from_dict, saved_config

    record = json.loads(objstore.read_bytes(objstore.join(root, "runs", run_id, "run.json")))
    return config_from_dict(saved_config(record["config"]))


# the main preset plus a reward role; the nightly config, registered separately as a user's would be, is PPO
# with a critic and a teacher: between them every role a run can start runs on the cluster path
# with every role group's Ray cluster of two nodes (a worker beside the head), so roles are placed across nodes
NIGHTLY = ["data.reward_role=false", "algorithm.advantage=gae", "model.value_head=true", "algorithm.stuck_group_push=0",
           "algorithm.distill_coef=0.5", "teacher.name_or_path=tiny-omni", "resources.workers=1",
           "resources.cpus_per_worker=1"]


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.ray
def test_the_workflow_a_killed_pod_a_cached_rerun_and_a_nightly_tick(tmp_path, moto_server):
    from dataclasses import replace

    from relax.services.driver import train
    from relax.transfer.weights import WeightStore

    # one tick: the schedule's next times are test_the_clock_fires_a_daily_schedule_at_its_next_times'; a
    # second tick (two minutes of a loaded 2-core machine) would add no role and no new kind of lineage link
    rc, s = cluster_run(tmp_path, "data.reward_role=true", "--ticks=1", *(f"--nightly={o}" for o in NIGHTLY))
    assert rc == 0 and s["ok"], json.dumps(s)[-3000:]
    nodes = {n["name"]: n for n in s["nodes"]}
    pids = [p for n in s["nodes"] for p in n["pids"]]
    assert len(pids) == len(set(pids)) > 30  # every pod a process of its own
    # both role groups ran at once, and each group's pod, SIGKILLed mid-run, was executed again
    for group in ("dn1:rollout_group", "dn2:learner_group"):
        node = nodes[f"main/n5/dyn/{group}"]
        assert node["attempts"] == 2 and node["status"] == "succeeded" and len(set(node["pids"])) == 2
    assert s["killed_pods"] == 2
    main = s["runs"]["omni-cpu"]
    assert main["steps"] == [0, 1, 2, 3] and main["lost"] == main["doubled"] == 0
    # the workflow's result: 4 steps, the final checkpoint under the run's root, its lineage to the snapshot
    assert s["registered"]["ok"] and s["registered"]["steps"] == 4
    assert s["registered"]["checkpoint"] == f"{s['root']}/runs/omni-cpu/checkpoints/step-000003"
    assert sorted(main["roles_started"]) == ["actor", "advantage", "reference", "reward", "rollout"]
    # the rerun: snapshot, warm start and both evaluations from the cache, and the finished run only
    # summarized (no role group, so no Ray cluster)
    assert s["cached_on_rerun"] == 4
    rerun = {n.split(":")[1]: v["status"] for n, v in nodes.items() if n.startswith("rerun/")}
    assert rerun["warm_start"] == rerun["evaluate"] == rerun["snapshot_dataset"] == "cached"
    assert "rollout_group" not in rerun and rerun["finish_run"] == "succeeded"
    # the tick, a run of its own with the nightly config's roles, continues the main run's lineage chain
    assert s["schedule_runs"] == 1 and s["lineage_chain_ok"] is True
    ticks = [r for r in s["runs"] if r.startswith("nightly-")]
    assert len(ticks) == 1
    for t in ticks:
        assert sorted(s["runs"][t]["roles_started"]) == ["actor", "advantage", "critic", "reference", "rollout",
                                                         "teacher"]
        assert s["runs"][t]["lost"] == s["runs"][t]["doubled"] == 0
    # the killed run ends where the same run never killed ends (exact staleness), trained here as OS processes
    killed = _run_config(s["root"], "omni-cpu")
    calm = replace(killed, root=f"file://{tmp_path}/calm")
    train(calm, progress=False)
    a, b = WeightStore(killed.root, "omni-cpu").load(4)[0], WeightStore(calm.root, "omni-cpu").load(4)[0]
    assert all(torch.equal(a[k], b[k]) for k in a), "the run whose pod was killed diverged"
