"""The deployment scenario ``infra/cluster_run.py`` runs, and the checks of its JSON summary.

On a local S3 server (moto, started here unless ``AWS_ENDPOINT_URL`` names one): the workflows are
packaged as a user registers them (the nightly launch plan's default config is the scenario's, via
``RELAX_NIGHTLY_CONFIG``), then executed by :class:`~infra.cluster.propeller.Propeller`:

1. ``omni_rl`` once, with the pod of ``rollout_group`` SIGKILLed after its first batch and the pod
   of ``learner_group`` after the actor's second step;
2. the same execution again: cached tasks must be skipped, the finished run trains nothing;
3. the nightly launch plan fired twice at the schedule's next two times (``kickoff_time`` as the
   scheduler sets it): two continuation runs whose lineage chain runs back through the first run.

The run itself is audited from the object store with relax's own readers: every role of
``role_names(cfg)`` left a log (it started), no sample lost or consumed twice.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import replace
from datetime import datetime, timedelta, timezone
from pathlib import Path

import yaml

from infra.cluster.flyte_objects import package, storage_env
from infra.cluster.propeller import KillPlan, NodeFailed, Propeller

REPO = Path(__file__).resolve().parents[2]
IMAGE_FILES = ("pyproject.toml", "README.md", "LICENSE", "relax", "tasks", "workflows")  # infra/Dockerfile's COPYs
SHORT = ["data.train_per_task=4", "data.eval_per_task=2", "trainer.total_steps=4", "trainer.checkpoint_every=2",
         "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=2", "trainer.sft_steps=2",
         "trainer.mini_batches=1", "supervisor.backoff_s=0.2"]


def start_s3(log_dir: Path) -> tuple[str, subprocess.Popen | None]:
    """The S3 endpoint: ``$AWS_ENDPOINT_URL`` if set, else a moto server started here."""
    if os.environ.get("AWS_ENDPOINT_URL"):
        return os.environ["AWS_ENDPOINT_URL"], None
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-p", str(port)],
                            stdout=open(log_dir / "moto.log", "wb"), stderr=subprocess.STDOUT)
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while True:
        try:
            urllib.request.urlopen(endpoint, timeout=1)
            return endpoint, proc
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError("the local S3 server (moto) did not start") from None
            time.sleep(0.2)


def image_root(dest: Path) -> Path:
    """What the task image holds in its working folder (infra/Dockerfile): the pods' cwd."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in IMAGE_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"), dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    return dest


def schedule_ticks(cron: str, after: datetime, n: int) -> list[datetime]:
    """The next ``n`` times a daily ``M H * * *`` cron fires after ``after`` (what the scheduler would pass)."""
    minute, hour, *rest = cron.split()
    if rest != ["*", "*", "*"]:
        raise ValueError(f"the emulator's clock fires daily schedules only, got {cron!r}")
    t = after.replace(hour=int(hour), minute=int(minute), second=0, microsecond=0)
    if t <= after:
        t += timedelta(days=1)
    return [t + timedelta(days=i) for i in range(n)]


def audit(cfg) -> dict:
    """Lost and doubled samples, and roles started, of ``cfg``'s run, read from the run root."""
    from collections import Counter

    from relax import objstore
    from relax.services.queue_contract import ACTOR_GROUP
    from relax.services.roles.factory import role_names
    from relax.services.run_context import RunContext
    from relax.transfer.consumer import load_group_state

    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    st = load_group_state(queue, ACTOR_GROUP)
    counts = Counter(sid for rec in st.steps.values() for sid in rec["ids"])
    expected = cfg.trainer.total_steps * ctx.batch_size
    started = [r for r in role_names(cfg) if objstore.exists(objstore.join(ctx.run_url, "logs", r))]
    return {"lost": max(0, expected - len(counts)), "doubled": sum(n - 1 for n in counts.values() if n > 1),
            "roles_started": started, "role_names": list(role_names(cfg)), "steps": sorted(st.steps)}


def registered(result, cfg) -> dict:
    """What the workflow returned (``OmniRLResult``, read from its output literal): the trained steps,
    the registered checkpoint and whether the lineage it carries starts at that checkpoint and ends
    at the dataset snapshot the run trained on."""
    import msgpack

    (lit,) = result.literals.values()
    r = msgpack.unpackb(lit.scalar.binary.value)
    steps = r["lineage"]["steps"]
    return {"steps": r["train"]["steps"], "checkpoint": r["train"]["checkpoint"],
            "ok": (r["train"]["steps"] == cfg.trainer.total_steps and r["train"]["checkpoint"].startswith(cfg.root)
                   and bool(steps) and r["train"]["checkpoint"].endswith(steps[0]["checkpoint"])
                   and steps[-1]["parent"] == "" and steps[-1]["dataset_snapshot"] == r["snapshot"]["id"])}


def lineage_ok(root: str, runs: list[str]) -> bool:
    """The newest run's chain holds every step of ``runs`` (oldest first), newest first, back to a
    record without a parent (the first run's format warm start, when it had one), and ``relax lineage``
    prints it."""
    from relax.config.tree import WARM_START_RUN
    from relax.transfer.lineage import chain

    records = chain(root, runs[-1])
    seen = [r.run_id for r in records]
    order = [run for i, run in enumerate(seen) if i == 0 or seen[i - 1] != run]
    if order[-1:] == [WARM_START_RUN] and WARM_START_RUN not in runs:
        order.pop()
    shown = subprocess.run([sys.executable, "-m", "relax.cli.main", "lineage", root, runs[-1]],
                           capture_output=True, text=True, timeout=300)
    return (order == list(reversed(runs)) and records[-1].parent is None and shown.returncode == 0
            and all(run in shown.stdout for run in runs))


def run_scenario(work: Path, overrides: list[str], preset: str = "omni-cpu", kill: bool = True,
                 rerun: bool = True, ticks: int = 2, nightly: list[str] | None = None) -> dict:
    """Everything above; returns the summary (also the last line ``cluster_run.py`` prints).
    ``nightly``: overrides of the nightly launch plan's config over the run's (as a user registers
    a nightly config of its own)."""
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    from relax.config import RelaxConfig, config_to_dict, load_config
    from relax.services.report.metrics import read_metrics
    from tasks.retrain import retrain_run_id

    work.mkdir(parents=True, exist_ok=True)
    logs = work / "logs"
    logs.mkdir(exist_ok=True)
    endpoint, moto = start_s3(logs)
    env = {**os.environ, **storage_env(endpoint, os.environ.get("AWS_ACCESS_KEY_ID", "testing"),
                                       os.environ.get("AWS_SECRET_ACCESS_KEY", "testing"))}
    os.environ.update(env)  # the audits below read the store as the pods do
    try:
        import fsspec

        bucket = f"relax-cluster-{int(time.time() * 1000) % 10**9}"
        fsspec.filesystem("s3").mkdir(bucket)
        cfg = load_config(preset, [f"root=s3://{bucket}/relax", *SHORT, *overrides])
        night = load_config(
            preset, [f"root=s3://{bucket}/relax", *SHORT, *overrides, "run_id=nightly", *(nightly or [])]
        )
        (work / "nightly.yaml").write_text(yaml.safe_dump(config_to_dict(night)))
        pkg = package(REPO, work, {**env, "RELAX_NIGHTLY_CONFIG": str(work / "nightly.yaml")})
        prop = Propeller(pkg, f"s3://{bucket}/flyte", image_root(work / "image"), env, logs)
        ctx = FlyteContextManager.current_context()
        cfg_lit = TypeEngine.to_literal(ctx, cfg, RelaxConfig, TypeEngine.to_literal_type(RelaxConfig)).to_flyte_idl()
        run_url = f"{cfg.root}/runs/{cfg.run_id}"
        if kill:  # each role group's pod lost once: the rollout's after its first batch, the learner's after a step
            prop.kills += [
                KillPlan("tasks.train.rollout_group",
                         lambda: any(m.get("batch", -1) >= 0 for m in read_metrics(run_url, "rollout"))),
                KillPlan("tasks.train.learner_group",
                         lambda: any(m.get("step", -1) >= 1 for m in read_metrics(run_url, "actor")))]
        summary: dict = {"nodes": [], "root": cfg.root, "runs": {}, "schedule_runs": 0, "cached_on_rerun": 0,
                         "lineage_chain_ok": False}
        ok = True
        try:
            result = prop.launch("workflows.omni_rl.omni_rl", "main", {"cfg": cfg_lit})
            summary["runs"][cfg.run_id] = audit(cfg)
            summary["registered"] = registered(result, cfg)
            summary.update({k: summary["runs"][cfg.run_id][k]
                            for k in ("lost", "doubled", "roles_started", "role_names")})
            summary["killed_pods"] = sum(k.done for k in prop.kills)
            if rerun:
                prop.launch("workflows.omni_rl.omni_rl", "rerun", {"cfg": cfg_lit})
                summary["cached_on_rerun"] = sum(r.status == "cached" for r in prop.records
                                                 if r.name.startswith("rerun/"))
            lp = pkg.launch_plans["omni_rl_nightly"]
            cron = lp.entity_metadata.schedule.cron_schedule.schedule
            runs = [cfg.run_id]
            for i, tick in enumerate(schedule_ticks(cron, datetime.now(timezone.utc), ticks)):
                lit = TypeEngine.to_literal(ctx, tick, datetime, TypeEngine.to_literal_type(datetime)).to_flyte_idl()
                prop.launch("omni_rl_nightly", f"tick{i + 1}", {"kickoff_time": lit})
                runs.append(retrain_run_id("nightly", tick))
                summary["schedule_runs"] += 1
                tick_audit = summary["runs"][runs[-1]] = audit(replace(night, run_id=runs[-1]))
                summary["lost"] += tick_audit["lost"]
                summary["doubled"] += tick_audit["doubled"]
            summary["lineage_chain_ok"] = lineage_ok(cfg.root, runs) if ticks else None
        except NodeFailed as e:
            ok = False
            summary["error"] = str(e)
        summary["nodes"] = prop.summary()
        prop.dump(work / "nodes.json")
        prop.close()
        summary["ok"] = ok and passed(summary)
        return summary
    finally:
        if moto is not None:
            moto.terminate()


def passed(s: dict) -> bool:
    """The exit criteria: every node succeeded (or was cached), every role started, nothing lost or
    doubled, the lineage chain holds, and every pod was a process of its own."""
    pids = [p for n in s["nodes"] for p in n["pids"]]
    return (all(n["status"] in ("succeeded", "cached") for n in s["nodes"]) and s["runs"]
            and s.get("registered", {}).get("ok", False)
            and all(set(r["role_names"]) <= set(r["roles_started"]) for r in s["runs"].values())
            and s.get("lost", 1) == 0 and s.get("doubled", 1) == 0
            and s["lineage_chain_ok"] is not False and len(pids) == len(set(pids)))


def print_summary(s: dict) -> None:
    print(json.dumps(s), flush=True)
