"""Learning is measured by training: GRPO on the arithmetic task raises the reward.

Seeded end to end (prompt order, sampling streams, initial weights), so on one machine the
run is the same every time; the bound below still leaves a wide margin over the measured
curve (first 20 batches ~0.02, last 20 ~0.1).
"""

from __future__ import annotations

import numpy as np
import pytest

from relax.config_loader import load_config
from relax.services.train import train

pytestmark = pytest.mark.slow


def test_grpo_raises_arithmetic_reward(tmp_path):
    cfg = load_config("tiny-cpu", [f"root=file://{tmp_path}", "run_id=learn", "data.tasks=[arithmetic]",
                                   "trainer.total_steps=100", "trainer.lr=3e-3", "trainer.checkpoint_every=50"])
    result = train(cfg, progress=False)
    rewards = [m["reward"] for m in sorted(result.metrics("rollout"), key=lambda m: m["batch"])]
    first, last = float(np.mean(rewards[:20])), float(np.mean(rewards[-20:]))
    print(f"reward first 20 batches {first:.3f}, last 20 {last:.3f}")
    assert last > max(2 * first, first + 0.03), (first, last)
