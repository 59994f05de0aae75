"""What a new user and CI rely on at the top of the repository."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_readme_opens_with_the_two_commands():
    text = (REPO / "README.md").read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.strip().splitlines()]
    assert commands == ["make run", "make test"]
    assert text.index("```bash") < text.index("## What this is")


def test_ci_runs_the_readme_test_command_and_fails_loudly():
    ci = (REPO / ".ci" / "run").read_text()
    assert "set -euo pipefail" in ci and re.search(r"^make test\b", ci, re.M)
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^test: setup\n\t\$\(BIN\)/pytest -m \"not gpu\"", makefile, re.M)


def test_make_test_fast_leaves_out_the_slow_and_gpu_markers():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r'^test-fast: setup\n\t\$\(BIN\)/pytest -m "not slow and not gpu" \$\(PYTEST_ARGS\)$',
                     makefile, re.M)
    assert "test-fast" in re.search(r"^\.PHONY:(.*)$", makefile, re.M).group(1).split()


def test_markers_and_license():
    pyproject = (REPO / "pyproject.toml").read_text()  # no tomllib: Python 3.10 is supported
    block = re.search(r"^markers = \[(.*?)^\]", pyproject, re.S | re.M).group(1)
    assert set(re.findall(r'^\s*"(\w+):', block, re.M)) == {"slow", "gpu", "s3", "ray"}
    assert re.search(r'^license = "Apache-2.0"$', pyproject, re.M)
    assert "Apache License" in (REPO / "LICENSE").read_text()[:200]


def test_engine_never_imports_flyte():
    # DESIGN.md: nothing under relax/ imports Flyte, so the engine runs from plain Python too.
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "relax").rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+flytekit", p.read_text(), re.M)]
    assert offenders == []
