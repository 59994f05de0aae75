"""Deltas are exact: a short run publishes the same bits and trains the same steps with them on or off."""

from __future__ import annotations

import torch

from relax.services.driver import train
from relax.transfer.weights import WeightStore
from tests.relax.services.runtime_helpers import tiny_config


def run(root, full_every: int):
    # bf16 weights: an AdamW step leaves most elements' bits as they were, so deltas are stored
    cfg = tiny_config(f"file://{root}", "r", "trainer.total_steps=3", "model.dtype=bfloat16",
                      f"weights.full_every={full_every}", "algorithm.entropy_coef=0.01")
    summary = train(cfg, progress=False)
    return [(m["loss"], m["grad_norm"]) for m in summary.metrics("actor")], summary.metrics("rollout")


def test_a_run_with_deltas_equals_one_without(tmp_path):
    (steps_on, rollouts_on), (steps_off, rollouts_off) = run(tmp_path / "on", 8), run(tmp_path / "off", 1)
    assert steps_on == steps_off and len(steps_off) == 3
    rewards = [{k: v for k, v in r.items() if k.startswith("reward")} for r in rollouts_off]
    assert rewards and all(rewards) and rewards == [{k: v for k, v in r.items() if k.startswith("reward")}
                                                    for r in rollouts_on]
    on, off = WeightStore(f"file://{tmp_path}/on", "r"), WeightStore(f"file://{tmp_path}/off", "r")
    assert set(off.versions()) <= set(on.versions())  # retention keeps what kept deltas are rebuilt from
    assert any("delta" in on.manifest(v) for v in on.versions())  # the deltas path really ran
    assert not any("delta" in off.manifest(v) for v in off.versions())
    for v in off.versions():
        a, b = on.load(v)[0], off.load(v)[0]
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)) for k in a)
