"""Learning is measured by training: GRPO on the arithmetic task raises the reward, on the PyTorch
backend and on the Megatron backend, whose curve tracks PyTorch's.

Seeded end to end (prompt order, sampling streams, initial weights), so on one machine the
run is the same every time; the bound below still leaves a wide margin over the measured
curve (60 steps: first 20 batches 0.014, last 20 0.080 on both backends, batch for batch the
same). Each run is ``relax train`` as a user runs it, in its own process (megatron's state is
process-wide); the PyTorch run is shared by both tests.
"""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from relax.services.report.metrics import read_all_metrics

pytestmark = pytest.mark.slow

COMMON = ["data.tasks=[arithmetic]", "trainer.total_steps=60", "trainer.lr=3e-3", "trainer.checkpoint_every=30"]


def _curve(root: str, backend: str) -> list[float]:
    """The rollout's reward per batch of a 60-step ``relax train`` on ``backend``."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax.cli.main",
            "train",
            *COMMON,
            f"trainer.backend={backend}",
            f"root={root}",
            "run_id=learn",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rollout = read_all_metrics(f"{root}/runs/learn")["rollout"]
    return [m["reward"] for m in sorted(rollout, key=lambda m: m["batch"])]


@pytest.fixture(scope="module")
def torch_curve(tmp_path_factory: pytest.TempPathFactory) -> list[float]:
    return _curve(f"file://{tmp_path_factory.mktemp('torch')}", "torch")


def _learns(rewards: list[float]) -> tuple[float, float]:
    first, last = float(np.mean(rewards[:20])), float(np.mean(rewards[-20:]))
    assert last > max(2 * first, first + 0.03), (first, last)
    return first, last


def test_grpo_raises_arithmetic_reward(torch_curve):
    first, last = _learns(torch_curve)
    print(f"reward first 20 batches {first:.3f}, last 20 {last:.3f}")


def test_megatron_backend_learns_and_tracks_the_pytorch_backend(tmp_path, torch_curve):
    # the same config on megatron-core: same initial weights, same data, so the curves track each other
    pytest.importorskip("megatron.core", exc_type=ImportError)
    first, last = _learns(_curve(f"file://{tmp_path}/megatron", "megatron"))
    other = float(np.mean(torch_curve[-20:]))
    print(f"megatron reward first 20 {first:.3f}, last 20 {last:.3f}; torch last 20 {other:.3f}")
    assert abs(last - other) < 0.05, (last, other)
