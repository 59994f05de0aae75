"""Dry-run a deployment: the registered workflows executed as a Flyte cluster runs them, minus Kubernetes.

    python infra/cluster_run.py [--preset P] [--work DIR] [--no-kill] [--no-rerun] [--ticks N]
                                [--nightly key=value ...] [key=value ...]

Packages the workflows as ``pyflyte package`` does, then executes them node by node: every node
a process of its own running the task's container command (``pyflyte-execute``), inputs and
outputs through a local S3 server, the two role groups at once, each Ray task on a Ray cluster
of its own, retries, the cache, and the nightly schedule fired twice (infra/cluster/scenario.py).
The last line printed is a JSON summary; the exit status is 0 only when every check held.
A tool for tests and for trying a config before deploying it, not part of the product.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from infra.cluster.scenario import print_summary, run_scenario  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("overrides", nargs="*", help="config overrides key=value, over the preset and the short run")
    p.add_argument("--preset", default="omni-cpu", help="config preset the run starts from (default omni-cpu)")
    p.add_argument("--work", default=None, help="folder for logs, the package and the pods' image root")
    p.add_argument("--no-kill", action="store_true", help="do not SIGKILL the role groups' pods mid-run")
    p.add_argument("--no-rerun", action="store_true", help="do not execute the workflow a second time")
    p.add_argument("--ticks", type=int, default=2, help="nightly schedule ticks to fire (default 2)")
    p.add_argument("--nightly", action="append", default=[], metavar="KEY=VALUE",
                   help="an override of the nightly launch plan's config only (repeatable)")
    args = p.parse_args(argv)
    work = Path(args.work or tempfile.mkdtemp(prefix="relax-cluster-"))
    print(f"cluster_run: logs and pods' output under {work}", file=sys.stderr, flush=True)
    summary = run_scenario(work, args.overrides, args.preset, kill=not args.no_kill, rerun=not args.no_rerun,
                           ticks=args.ticks, nightly=args.nightly)
    print_summary(summary)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
