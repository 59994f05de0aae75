"""Rollout routing replay in a run: the rollout commits each row's experts, the actor trains on them,
and the first (on-policy) step sees exactly the engine's log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from relax.config_loader import ConfigError, load_config
from relax.services.context import RunContext
from relax.services.train import train
from tests.relax.services.runtime_helpers import tiny_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("engines", [0, 1], ids=["in-process engine", "engine process over HTTP"])
def test_a_run_with_routing_replay_trains_on_the_engines_experts(tmp_path, engines):
    cfg = tiny_config(f"file://{tmp_path}", "r3", "model.family=qwen3_moe", "algorithm.routing_replay=true",
                      "trainer.total_steps=2", "trainer.checkpoint_every=2", f"rollout.engine_processes={engines}")
    result = train(cfg, progress=False)
    assert result.steps == 2
    queue = RunContext(cfg).queue()
    queue.refresh()
    rows = queue.read(list(queue.state.samples), ["tokens", "routed_experts", "prompt_len"])
    for tokens, routes in zip(rows["tokens"], rows["routed_experts"], strict=True):
        assert routes.shape == (len(tokens), 2, 2) and routes.dtype == np.int16  # tiny-qwen2: 2 layers, top-2
        assert (routes[-1] == -1).all()  # the last token was never fed to the engine
        assert ((routes[:-1] >= 0) & (routes[:-1] < 4)).all()  # 4 experts
    first = result.metrics("actor")[0]
    # version 0 trains on samples of version 0: same weights, same experts -> ratio 1 at every token
    assert first["approx_kl"] < 1e-9 and abs(first["ratio_mean"] - 1) < 1e-6


@pytest.mark.parametrize("override, named", [
    ("model.family=qwen2", "model.family=qwen2"),
    ("trainer.micro_batch_layout=prefix", "trainer.micro_batch_layout=prefix"),
])
def test_routing_replay_is_refused_where_nothing_records_or_replays_routes(override, named):
    family = [] if override.startswith("model.family") else ["model.family=qwen3_moe"]
    with pytest.raises(ConfigError, match=f"routing_replay=true cannot run with .*{named}"):
        load_config(None, ["algorithm.routing_replay=true", *family, override])
