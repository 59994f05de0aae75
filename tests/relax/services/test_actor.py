"""The actor role's proximal-policy shortcut: on-policy rows from the native float32 engine
reuse their behaviour logprobs instead of a recomputing forward pass, and train the same."""

from __future__ import annotations

import pytest
import torch

import relax.services.actor as actor_role
from relax.services.actor import behaviour_is_proximal
from relax.services.context import RunContext
from relax.services.controller import train
from relax.trainers.torch.actor import Actor
from tests.relax.services.runtime_helpers import tiny_config


def _cfg(*overrides: str):
    return tiny_config("file:///unused", "p", *overrides)


def test_only_rows_of_the_current_weights_from_an_exact_engine_reuse_their_logprobs():
    cfg = _cfg()
    assert behaviour_is_proximal(cfg, [3, 3, 3], version=3)
    assert not behaviour_is_proximal(cfg, [3, 2, 3], version=3)  # one stale row: recompute the batch
    sglang = _cfg("rollout.engine=sglang", "resources.num_gpus=1", "resources.rollout_gpus=1")
    assert not behaviour_is_proximal(sglang, [3, 3, 3], version=3)
    assert not behaviour_is_proximal(_cfg("model.dtype=bfloat16"), [3, 3, 3], version=3)
    assert not behaviour_is_proximal(_cfg("algorithm.off_policy=none"), [3, 3, 3], version=3)


def _run(root: str, monkeypatch, reuse: bool) -> tuple[dict, int]:
    calls = []
    original = Actor.logprobs
    monkeypatch.setattr(Actor, "logprobs", lambda self, batch: calls.append(1) or original(self, batch))
    if not reuse:
        monkeypatch.setattr(actor_role, "behaviour_is_proximal", lambda *a: False)
    cfg = tiny_config(root, "p", "trainer.total_steps=3", "trainer.lr=1e-2", "trainer.warmup_steps=0",
                      "trainer.mini_batches=2")
    train(cfg, progress=False)
    store = RunContext(cfg).weights()
    monkeypatch.undo()
    return store.load(store.latest())[0], len(calls)


@pytest.mark.slow
def test_reusing_behaviour_logprobs_trains_like_recomputing_them(tmp_path, monkeypatch):
    reused, forwards_reused = _run(f"file://{tmp_path}/a", monkeypatch, reuse=True)
    recomputed, forwards_recomputed = _run(f"file://{tmp_path}/b", monkeypatch, reuse=False)
    assert forwards_recomputed == 3 and forwards_reused == 0  # colocated steps are on-policy
    for name, w in recomputed.items():
        torch.testing.assert_close(torch.as_tensor(reused[name]), torch.as_tensor(w), atol=1e-4, rtol=0)
