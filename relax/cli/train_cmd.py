"""``relax train``, ``relax role`` and ``relax status``: run, serve one role, inspect a run.

``relax train [preset|file] [key=value ...]`` runs a whole run in ``topology`` (after the format
warm-start when ``trainer.sft_steps`` > 0); running the same command again resumes it (same run
id, same config). ``--fork`` accepts a changed
config for an existing run id. ``relax role NAME CONFIG`` is one role's loop (what the
disaggregated topology starts per process). ``relax status ROOT [RUN]`` shows roles,
versions, queue depth, staleness and restarts per role from the store alone.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import time
import traceback

from relax import objstore
from relax.cli.args import CommandError, config_from_args
from relax.config import config_from_dict, saved_config
from relax.services.heartbeat import last_progress
from relax.services.queue_contract import ACTOR_GROUP, ADVANTAGE_GROUP
from relax.services.report.metrics import ROLES, read_metrics
from relax.services.run_context import RunContext
from relax.services.supervision import read_restarts, restart_events
from relax.transfer.consumer import load_group_state


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="run (or resume) an RL run", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="*", help="[preset or config file] then key=value overrides")
    p.add_argument("--fork", action="store_true", help="accept a config that differs from the run's record")
    p.add_argument("--resume", action="store_true", help="require that the run exists (fail instead of starting)")
    p.add_argument("--engine-url", action="append", default=[], help="serve rollout from these engine URLs")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=_train)

    r = sub.add_parser("role", help="run one role of a run in this process (disaggregated topology)")
    r.add_argument("name", choices=ROLES)
    r.add_argument("args", nargs="*", help="[preset or config file] then key=value overrides")
    r.set_defaults(func=_role)

    s = sub.add_parser("status", help="roles, versions, queue depth and staleness of runs")
    s.add_argument("root", help="the run root (any fsspec URL)")
    s.add_argument("run", nargs="?", default=None, help="run id (default: every run under the root)")
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=_status)


# the pipeline and the roles import torch and transformers (~4 s): only the sub-commands that train do
def _train(args: argparse.Namespace) -> int:
    from relax.pipeline import train_run

    cfg = config_from_args(args.args)
    if args.resume and not objstore.exists(objstore.join(RunContext(cfg).run_url, "run.json")):
        raise SystemExit(f"error: --resume: no run {cfg.run_id!r} under {cfg.root}")
    summary = train_run(cfg, fork=args.fork, progress=not args.no_progress, engine_urls=args.engine_url or None)
    print(f"run {cfg.run_id}: {summary.steps} steps, policy version {summary.steps}, training reward "
          f"{summary.reward_first:.3f} (first tenth) -> {summary.reward_last:.3f} (last tenth)")
    print(f"  checkpoint: {summary.checkpoint}\n  report: {summary.report_dir} (curves.png, metrics.jsonl, "
          f"events.out.tfevents.relax)")
    return 0


def _role(args: argparse.Namespace) -> int:
    from relax.faults import ATTEMPT_ENV, set_role_process
    from relax.services.report.role_logs import write_role_error
    from relax.services.topologies.runner import run_role

    set_role_process()  # an injected fault (RELAX_FAULT) kills this process, as a real crash would
    # a controller that finds this role hung asks for its stacks before it kills it (RoleProcess.kill_hung)
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        run_role(args.name, config_from_args(args.args), attempt=int(os.environ.get(ATTEMPT_ENV) or 0))
    except BaseException:  # the controller quotes this traceback, not the log's last lines
        write_role_error(traceback.format_exc())
        raise
    return 0


def run_status(root: str, run_id: str) -> dict:
    """What ``relax status`` shows for one run, read from the store only."""
    from relax.services.roles.actor import list_checkpoints

    run_url = objstore.join(objstore.absolute_url(root), "runs", run_id)
    record = json.loads(objstore.read_bytes(objstore.join(run_url, "run.json")))
    cfg = config_from_dict({**saved_config(record["config"]), "root": root})
    ctx = RunContext(cfg)
    queue = ctx.queue()
    queue.refresh()
    out: dict = {"run_id": run_id, "topology": cfg.topology, "dataset_snapshot": record.get("dataset_snapshot"),
                 "weight_versions": ctx.weights().versions()[-3:], "checkpoints": list_checkpoints(ctx)[-3:],
                 "committed_samples": len(queue.state.samples), "roles": {}}
    for group in (ADVANTAGE_GROUP, ACTOR_GROUP):
        st = load_group_state(queue, group)
        out[f"{group}_steps"] = st.last_step + 1
        out[f"{group}_pending"] = len(queue.state.samples) - len(st.consumed.keys() | st.dropped.keys())
        out[f"{group}_dropped"] = len(st.dropped)
    now = time.time()
    out["restarts"] = restarts = read_restarts(run_url)  # roles the supervisor healed (relax.services.supervision)
    why = {e["role"]: e["exit"] for e in restart_events(run_url)}  # each role's latest restart, oldest first
    for role in ROLES:
        ms = read_metrics(run_url, role)
        beat = last_progress(run_url, role, now)
        if not ms and beat is None:
            continue
        info: dict = {"records": len(ms), "restarts": restarts.get(role, 0)}
        if role in why:
            info["last_restart"] = why[role]
        if beat is not None:  # what a hang watch sees (relax.services.heartbeat)
            info.update(attempt=beat["attempt"], state=beat["state"], progress_s=beat["progress_s"],
                        max_gap_s=beat["max_gap_s"])
        if ms:
            last = ms[-1]
            info.update({"last_seen_s": round(now - last["time"], 1),
                         **{k: last[k] for k in ("step", "batch", "version", "weight_version", "reward", "loss",
                                                 "staleness_max", "samples_per_s") if k in last}})
        out["roles"][role] = info
    return out


def runs_to_show(root: str, run: str | None) -> list[str]:
    """The runs ``relax status ROOT [RUN]`` shows; a CommandError when there is none to show, since
    printing nothing would look like a root whose runs have nothing to report."""
    url = objstore.absolute_url(root)
    base = objstore.join(url, "runs")
    runs = [r for r in objstore.list_dir(base) if objstore.exists(objstore.join(base, r, "run.json"))]
    start = f"start one there with `relax train root={root} ...` (or `relax run`)"
    if not objstore.exists(url):
        raise CommandError(f"no run root at {url}: nothing is there. A root holds runs/<run_id>/run.json, written "
                           f"when a run starts; check the path (the default root is ./.relax) or {start}")
    if not runs:
        raise CommandError(f"no runs under {url} (no runs/<run_id>/run.json there); check the path or {start}")
    if run is not None and run not in runs:
        raise CommandError(f"no run {run!r} under {url}; the runs there are {', '.join(runs)}")
    return [run] if run is not None else runs


def _status(args: argparse.Namespace) -> int:
    for run in runs_to_show(args.root, args.run):
        st = run_status(args.root, run)
        if args.json:
            print(json.dumps(st, sort_keys=True))
            continue
        print(f"run {run} ({st['topology']}), dataset {st['dataset_snapshot']}")
        print(f"  weights: versions {st['weight_versions']}   checkpoints: steps {st['checkpoints']}")
        print(f"  queue: {st['committed_samples']} samples; advantage pending {st['advantage_pending']}, "
              f"actor pending {st['actor_train_pending']}, dropped {st['actor_train_dropped']}")
        for role, info in st["roles"].items():
            fields = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in info.items())
            print(f"  {role:9s} {fields}")
    return 0
