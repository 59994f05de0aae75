"""``relax lineage``: show where a checkpoint came from, as text, JSON or a picture.

Why a command: "which data and code made this checkpoint?" is asked by people looking at
a bucket, not by code, so the answer must be one command away from any run root.
"""

from __future__ import annotations

import argparse
import json
import sys

from relax.objstore import absolute_url
from relax.transfer.lineage import LineageError, chain, chain_to_json, chain_to_text, list_records, list_runs
from relax.transfer.lineage_render import render


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lineage",
        help="trace checkpoints back to their samples and dataset snapshot",
        description="relax lineage ROOT [RUN] [--checkpoint C] [--json] [--graph out.png|out.svg]. "
        "Without RUN: lists the runs that have lineage records (or shows the only one). With RUN: the "
        "chain from its latest checkpoint (or --checkpoint) back through parents, into earlier runs.",
    )
    p.add_argument("root", help="the run root (any fsspec URL or local folder) holding runs/<run_id>/lineage/")
    p.add_argument("run", nargs="?", default=None, help="run id; default: the only run with lineage")
    p.add_argument("--checkpoint", default=None, help="start from this checkpoint (default: the run's latest)")
    p.add_argument("--json", action="store_true", help="print the chain as a JSON graph (nodes and edges)")
    p.add_argument("--graph", default=None, metavar="OUT.png|OUT.svg",
                   help="also draw the chain to this file or URL; the suffix picks the format")
    p.set_defaults(func=_lineage)


def _lineage(args: argparse.Namespace) -> int:
    root = absolute_url(args.root)
    run = args.run
    if run is None:
        runs = list_runs(root)
        if not runs:
            raise LineageError(f"no lineage records under {root}/runs; a training run writes them at each "
                               f"checkpoint")
        if len(runs) > 1:
            if args.checkpoint or args.graph:
                raise LineageError(f"{len(runs)} runs have lineage under {root}; name one: "
                                   f"relax lineage {args.root} RUN ({', '.join(runs)})")
            _print_runs(root, runs, as_json=args.json)
            return 0
        run = runs[0]
    records = chain(root, run, args.checkpoint)
    if args.json:
        print(json.dumps(chain_to_json(records), indent=2, sort_keys=True))
    else:
        print(chain_to_text(records), end="")
    if args.graph:
        written = render(records, args.graph)
        # Keep stdout pure JSON when --json asked for it.
        print(f"graph written to {written}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_runs(root: str, runs: list[str], as_json: bool) -> None:
    """One line per run: its checkpoint count and latest checkpoint (oldest run name first)."""
    summary = []
    for run in runs:
        records = list_records(root, run)
        latest = records[-1]
        summary.append({"run_id": run, "checkpoints": len(records), "latest": latest.checkpoint,
                        "step": latest.step, "dataset_snapshot": latest.dataset_snapshot,
                        "parent": None if records[0].parent is None else str(records[0].parent)})
    if as_json:
        print(json.dumps({"root": root, "runs": summary}, indent=2, sort_keys=True))
        return
    print(f"{len(runs)} runs with lineage under {root}:")
    width = max(len(s["run_id"]) for s in summary)
    for s in summary:
        origin = f"  continues {s['parent']}" if s["parent"] else ""
        print(f"  {s['run_id'].ljust(width)}  {s['checkpoints']} checkpoint(s), latest {s['latest']} "
              f"(step {s['step']}), dataset {s['dataset_snapshot']}{origin}")
    print(f"show one with: relax lineage {root} RUN")
