"""The docs name files that exist: a moved or deleted module fails here, not in a reader's hands."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# a repository path: starts at a top-level folder (not inside ./.relax/... or a URL), ends in a file or folder name
PATH = re.compile(r"(?<![\w./-])(relax|tests|benchmarks|tasks|workflows|infra|docs)/[\w./-]*\w")


def named_paths(text: str) -> set[str]:
    return {m.group(0) for m in PATH.finditer(text)}


def test_path_pattern():
    text = "see `relax/services/driver.py`, tests/test_docs.py::test_x, ./.relax/runs/x and s3://b/relax/y"
    assert named_paths(text) == {"relax/services/driver.py", "tests/test_docs.py"}


def test_every_path_the_docs_name_exists():
    docs = [REPO / "README.md", *(REPO / "docs").glob("*.md")]  # docs/history/ records the past as it was
    missing = sorted(f"{d.relative_to(REPO)}: {p}" for d in docs for p in named_paths(d.read_text())
                     if not (REPO / p).exists())
    assert missing == []


def test_architecture_names_every_module():
    text = (REPO / "docs" / "architecture.md").read_text()
    modules = sorted(str(p.relative_to(REPO)) for top in ("relax", "tasks", "workflows")
                     for p in (REPO / top).rglob("*.py") if p.name != "__init__.py")
    assert [m for m in modules if m not in text] == []
