"""``relax report``: regenerate a run's report, or send its trackers what they missed.

``relax report ROOT RUN`` rewrites ``<run>/report/`` (curves.png, report.html, metrics.jsonl and
the TensorBoard events) from the metrics the roles logged, at any time, also while the run trains.
``relax report sync ROOT RUN [report.key=value ...]`` sends ``report.trackers`` every step and the
newest checkpoint they have not accepted (after a tracker was down: docs/tracking.md); overrides of
the report section point it elsewhere, e.g. ``report.mlflow_uri=http://mlflow:5000``.
"""

from __future__ import annotations

import argparse
import json

from relax import objstore
from relax.cli.args import CommandError, split_overrides
from relax.config import ConfigError, config_from_dict, parse_override, saved_config


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("report", help="regenerate a run's report (curves, HTML), or `sync` its trackers",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("args", nargs="+", metavar="[sync] ROOT RUN [report.key=value ...]")
    p.set_defaults(func=_report)


def run_config(root: str, run: str, overrides: list[str]):
    """The config ``run`` was started with (its run.json), at ``root``, with report-section overrides."""
    url = objstore.join(objstore.absolute_url(root), "runs", run, "run.json")
    if not objstore.exists(url):
        raise CommandError(f"no run {run!r} under {root}: {url} does not exist (relax status {root} lists the runs)")
    data = {**saved_config(json.loads(objstore.read_bytes(url))["config"]), "root": root}
    for text in overrides:
        key, value = parse_override(text)
        if not key.startswith("report."):
            raise ConfigError(f"{key}: only the report section may change here (it changes nothing the run "
                              f"computed); the rest is the run's own config")
        data.setdefault("report", {})[key[len("report."):]] = value
    return config_from_dict(data)


def _report(args: argparse.Namespace) -> int:
    from relax.services.report.metrics import write_report
    from relax.services.run_context import RunContext
    from relax.services.trackers.feed import sync_run

    positional, overrides = split_overrides(args.args)
    sync = bool(positional) and positional[0] == "sync"
    positional = positional[1:] if sync else positional
    if len(positional) != 2:
        raise CommandError("usage: relax report [sync] ROOT RUN [report.key=value ...]")
    cfg = run_config(*positional, overrides)
    ctx = RunContext(cfg)
    if sync:
        ok = sync_run(ctx)
        print(f"run {cfg.run_id}: {', '.join(cfg.report.trackers)} " + (
            "up to date" if ok else "not all reached (see the warnings above); run it again later"))
        return 0 if ok else 1
    urls = write_report(ctx.run_url, tensorboard="tensorboard" in cfg.report.trackers)
    print(f"run {cfg.run_id}: report written\n" + "\n".join(f"  {k}: {u}" for k, u in urls.items()))
    return 0
