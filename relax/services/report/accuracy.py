"""The before/after accuracy of a run, as a file beside its curves, and the check that the README
still prints what the main job prints.

``make run`` ends with a table of held-out accuracy per modality; the README publishes the same
numbers. When code under the run changes them, the README goes stale silently. So the run writes
``report/accuracy.json`` (per task and per modality, before and after RL), and ``make
check-readme`` (``python -m relax.services.report.accuracy README.md <accuracy.json>``) compares
it with the README's table, naming each row that differs and exiting non-zero.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

from relax import objstore

ACCURACY_FILE = "accuracy.json"
# | text | `largest` | 0.031 | 1.000 |  (modality, task, before, after)
_ROW = re.compile(r"^\|\s*(\w+)\s*\|\s*`([\w-]+)`\s*\|\s*([0-9.]+)\s*\|\s*([0-9.]+)\s*\|\s*$", re.M)


def accuracy_record(before: Any, after: Any) -> dict[str, Any]:
    """``before``/``after``: EvalReports. Rounded as the table prints them (3 decimals)."""
    tasks = sorted(set(before.accuracy) | set(after.accuracy))
    return {"tasks": {t: {"before": round(before.accuracy.get(t, float("nan")), 3),
                          "after": round(after.accuracy.get(t, float("nan")), 3)} for t in tasks},
            "modalities": {m: {"before": round(before.by_modality.get(m, float("nan")), 3),
                               "after": round(v, 3)} for m, v in sorted(after.by_modality.items())}}


def write_accuracy(report_dir: str, before: Any, after: Any) -> str:
    """Write ``<report_dir>/accuracy.json``; returns its URL."""
    url = objstore.join(report_dir, ACCURACY_FILE)
    objstore.write_bytes(url, json.dumps(accuracy_record(before, after), indent=1, sort_keys=True).encode())
    return url


def readme_mismatches(readme: str, record: dict[str, Any]) -> list[str]:
    """Rows of the README's accuracy table that differ from ``record`` (an ``accuracy.json``), each
    named; an empty list when they agree. A README without such a table is itself a mismatch."""
    rows = _ROW.findall(readme)
    if not rows:
        return ["README.md has no accuracy table (rows like | text | `largest` | 0.031 | 1.000 |)"]
    out = []
    for modality, task, before, after in rows:
        got = record.get("tasks", {}).get(task)
        if got is None:
            out.append(f"{modality}/{task}: the README names a task this run did not evaluate")
            continue
        for when, published in (("before", before), ("after", after)):
            if f"{got[when]:.3f}" != published:
                out.append(f"{modality}/{task} {when} RL: README {published}, the run {got[when]:.3f}")
    return out


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m relax.services.report.accuracy README.md <run>/report/accuracy.json", file=sys.stderr)
        return 2
    readme, where = args
    try:
        record = json.loads(objstore.read_bytes(where))
    except FileNotFoundError:
        print(f"{where} does not exist: run `make run` first", file=sys.stderr)
        return 2
    with open(readme, encoding="utf-8") as f:
        wrong = readme_mismatches(f.read(), record)
    for line in wrong:
        print(line, file=sys.stderr)
    if wrong:
        print(f"{readme} no longer prints what the run printed: update its table (and docs/benchmarks.md, "
              f"docs/quickstart.md) from {where}", file=sys.stderr)
        return 1
    print(f"{readme} agrees with {where}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
