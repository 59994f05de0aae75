"""What a new user and CI rely on at the top of the repository."""

from __future__ import annotations

import importlib.util
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
    assert re.search(r"^test: setup\n\t\$\(BIN\)/python infra/run_tests.py \$\(PYTEST_ARGS\)$", makefile, re.M)


def _run_tests():
    spec = importlib.util.spec_from_file_location("run_tests", REPO / "infra" / "run_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_make_tests_two_sessions_cover_every_test_file_once_and_the_local_one_shares_nothing():
    local = _run_tests().LOCAL
    assert all((REPO / p).exists() for p in local)
    files = sorted(REPO.glob("tests/**/test_*.py"))
    in_local = [f for f in files if any(str(f.relative_to(REPO)).startswith(p) for p in local)]
    assert 0 < len(in_local) < len(files)  # the rest is the cluster session: tests minus the local paths
    # the local session runs beside the cluster one: no session Ray cluster, no Flyte, no fixed ports
    shared = re.compile(r"ray_session|flytekit|pyflyte|ray\.init|ray start")
    # (the cluster emulator's test shares none: its Ray clusters have their own ports and temp folders, and
    # its pods their own TMPDIR, so the other session's clean-up of /tmp/flyte* cannot reach them)
    assert [str(f.relative_to(REPO)) for f in in_local if shared.search(f.read_text())
            and f.name not in ("test_layers.py", "test_repo.py", "test_registry.py", "test_loader.py", "test_tree.py",
                               "test_cluster.py")] == []


def test_make_tests_exit_status_fails_on_any_failure_and_on_an_empty_session():
    combined = _run_tests().combined
    assert combined([0, 0], filtered=False) == 0
    assert combined([1, 0], filtered=False) == 1 and combined([0, 2], filtered=True) == 2
    assert combined([0, 5], filtered=False) == 5  # a session without tests is a broken split, not a pass
    assert combined([5, 0], filtered=True) == 0  # ... unless the caller's -k filtered it empty
    assert combined([5, 5], filtered=True) == 5


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
    # docs/architecture.md: nothing under relax/ imports Flyte, so the engine runs from plain Python too.
    offenders = [str(p.relative_to(REPO)) for p in (REPO / "relax").rglob("*.py")
                 if re.search(r"^\s*(import|from)\s+flytekit", p.read_text(), re.M)]
    assert offenders == []
