"""Where a benchmark's results go: an untracked folder by default, the published ones on request.

Every benchmark takes the flags :func:`add_arguments` adds, and writes through :class:`Output`:

* by default its JSON goes to ``$RELAX_BENCH_OUT``, or ``benchmarks/results/local/`` (git-ignored),
  and its docs table, if it has one, to ``<block>.md`` beside it: running a benchmark never
  changes a tracked file;
* with ``--update-docs`` the JSON goes to ``benchmarks/results/<name>.json`` and the table
  replaces the benchmark's block of docs/benchmarks.md (between its ``<!-- block:begin -->`` and
  ``<!-- block:end -->`` markers, doc_table.py): what a commit publishing new figures runs;
* ``--out PATH`` writes the JSON to PATH instead, either way.

Benchmarks are scripts (``python benchmarks/<name>.py``): Python puts their folder first on
sys.path, which is how they import this module and each other.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

from doc_table import DOC, block_text, update_table

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"  # tracked: the figures docs/benchmarks.md quotes
LOCAL = RESULTS / "local"  # git-ignored: every other run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--update-docs", action="store_true",
                        help="publish: write benchmarks/results/<name>.json (tracked) and refresh this benchmark's "
                             "table in docs/benchmarks.md; without it results go to $RELAX_BENCH_OUT or "
                             "benchmarks/results/local/ (untracked)")
    parser.add_argument("--out", default=None, metavar="PATH", help="write the JSON result to PATH instead")


class Output:
    """Writes one benchmark run's JSON and table where :mod:`output`'s flags say."""

    def __init__(self, update_docs: bool = False, out: str | None = None):
        self.update_docs, self.out = update_docs, out

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> Output:
        return cls(args.update_docs, args.out)

    @property
    def folder(self) -> Path:
        return RESULTS if self.update_docs else Path(os.environ.get("RELAX_BENCH_OUT") or LOCAL)

    def write_json(self, name: str, result: Any, indent: int | None = 2) -> Path:
        """``result`` as ``<folder>/<name>.json`` (or ``--out``); returns the path."""
        path = Path(self.out) if self.out else self.folder / f"{name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=indent) + "\n")
        print(f"results: {path}", file=sys.stderr)
        return path

    def table(self, block: str, rows: list[str], heading: str) -> Path:
        """The table ``rows``: into docs/benchmarks.md's ``block`` with ``--update-docs``, else
        ``<folder>/<block>.md`` (heading and markers included, ready to paste)."""
        if self.update_docs:
            update_table(block, rows, heading)
            path = DOC
        else:
            path = self.folder / f"{block}.md"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(f"{heading}\n\n{block_text(block, rows)}\n")
        print(f"table: {path}", file=sys.stderr)
        return path
