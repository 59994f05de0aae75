"""Megatron checks run in child processes: megatron keeps process-wide state (its parallel groups),
so each test file runs itself as a script, once per rank over gloo on 127.0.0.1, and the ranks
write what they measured as files the tests read."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[4]
TINY = REPO / "tests" / "relax" / "trainers" / "torch"


def run_ranks(script: Path, world: int, *args: str, what: str = "", timeout: float = 600.0) -> None:
    """Run ``script RANK WORLD PORT *args`` for every rank at once; fails the test with the log of
    the first rank that exits non-zero."""
    with socket.socket() as s:  # a free port, without importing megatron into this process
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TINY}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(world), port, *args], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for rank in range(world)]
    logs = [p.communicate(timeout=timeout)[0] for p in procs]
    for rank, (p, log) in enumerate(zip(procs, logs, strict=True)):
        if p.returncode != 0:
            pytest.fail(f"{what or script.name} rank {rank} of {world} failed (rc={p.returncode}):\n{log[-4000:]}")


def run_child(script: Path, out: Path, timeout: float = 900.0) -> Any:
    """Run ``script OUT`` in one process; returns the JSON it wrote to ``out``."""
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{TINY}", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, str(script), str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.exists():
        pytest.fail(f"megatron child process failed (rc={proc.returncode}):\n{(proc.stdout + proc.stderr)[-4000:]}")
    return json.loads(out.read_text())
