"""Rollout routing replay in a run: the rollout commits each row's experts, the actor trains on them,
and the first (on-policy) step sees exactly the engine's log-probs."""

from __future__ import annotations

import numpy as np
import pytest

from relax.config import ConfigError, load_config
from relax.services.driver import train
from relax.services.run_context import RunContext
from relax.services.trainable import check_trainable
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
    ("trainer.backend=megatron trainer.pipeline_parallel=2", "trainer.pipeline_parallel=2"),
    ("trainer.backend=megatron trainer.context_parallel=2", "trainer.context_parallel=2"),
])
def test_routing_replay_is_refused_where_nothing_records_or_replays_routes(override, named):
    family = [] if override.startswith("model.family") else ["model.family=qwen3_moe"]
    with pytest.raises(ConfigError, match=f"routing_replay=true cannot run with .*{named}"):
        load_config(None, ["algorithm.routing_replay=true", *family, *override.split()])


def test_an_expert_parallel_megatron_moe_actor_replays_the_engines_experts_in_the_loop(tmp_path):
    # two training ranks (data_parallel=2), each holding half of every layer's experts (expert_parallel=2),
    # stepped by megatron's DistributedOptimizer (the dense weights' moments split over the two ranks),
    # checkpointed sharded (each rank writes its experts)
    pytest.importorskip("megatron.core", exc_type=ImportError)
    import os
    import subprocess
    import sys
    from pathlib import Path

    import torch

    from relax.services.report.metrics import read_metrics
    from relax.trainers.checkpoint.trainer_state import read_state
    from relax.transfer.weights import WeightStore

    repo = Path(__file__).resolve().parents[4]
    env = {**os.environ, "PYTHONPATH": str(repo), "PYTHONWARNINGS": "ignore"}
    env.pop("RELAX_FAULT", None)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "relax.cli.main",
            "train",
            "tiny-cpu",
            "data.tasks=[arithmetic]",
            "data.train_per_task=64",
            "data.eval_per_task=8",
            "rollout.prompts_per_step=4",
            "rollout.n_samples_per_prompt=4",
            "rollout.max_new_tokens=8",
            "trainer.total_steps=2",
            "trainer.checkpoint_every=2",
            f"root=file://{tmp_path}",
            "run_id=mr3",
            "topology=disaggregated",
            "model.family=qwen3_moe",
            "trainer.backend=megatron",
            "algorithm.routing_replay=true",
            "trainer.data_parallel=2",
            "trainer.expert_parallel=2",
            "trainer.lr=1e-3",
            "trainer.distributed_optimizer=true",
            "trainer.checkpoint_format=sharded",
            "data.reward_fn=tests.relax.services.runtime_helpers.length_reward",
            "--no-progress",
        ],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    actor = sorted(read_metrics(f"file://{tmp_path}/runs/mr3", "actor"), key=lambda m: m["step"])
    assert [(m["step"], m["ranks"]) for m in actor] == [(0, 2), (1, 2)]
    # megatron's MoE layers, split over two ranks and routed through the HF engine's experts, score
    # the engine's samples exactly; and the step is a real one (length_reward varies in every group)
    assert actor[0]["approx_kl"] < 1e-9 and abs(actor[0]["ratio_mean"] - 1) < 1e-6
    assert actor[0]["grad_norm"] > 0.01
    # the published version gathers both ranks' experts back into the HF layout
    store = WeightStore(f"file://{tmp_path}", "mr3")
    v0, v1 = store.load(0)[0], store.load(1)[0]
    experts = [k for k in v0 if "experts" in k]
    assert v0.keys() == v1.keys() and experts and all(v1[k].shape[0] == 4 for k in experts)  # 4 experts a layer
    assert all(not torch.equal(v0[k], v1[k]) for k in experts)  # both ranks' experts moved
    # the step-2 checkpoint is sharded: each expert-parallel rank wrote its own experts, and it
    # consolidates to AdamW's moments whole, by HF name, and the weights published with it
    ckpt = next(Path(tmp_path, "runs", "mr3").rglob("meta.json")).parent
    assert sorted(p.name for p in (ckpt / "shards").iterdir()) == ["tp0-pp0-ep0.pt", "tp0-pp0-ep1.pt"]
    _, state = read_state(str(ckpt))
    assert all(state["optimizer"]["state"][k]["exp_avg"].shape == v1[k].shape for k in experts)
    v2 = store.load(2)[0]  # the weights after step 1, the checkpointed step
    assert v2.keys() == state["model"].keys() and all(torch.equal(state["model"][k], v2[k]) for k in v2)


@pytest.mark.parametrize("override, named", [
    ("trainer.tensor_parallel=2", "needs megatron's sequence parallelism"),
    ("trainer.pipeline_parallel=2", "alltoall token dispatcher, which needs CUDA"),
    ("trainer.data_parallel=3 trainer.expert_parallel=3", "expert_parallel=3 splits .* this model has 4 per layer"),
    ("model.family=qwen2 trainer.data_parallel=2 trainer.expert_parallel=2", "this model has 0 per layer"),
])
def test_megatron_moe_layouts_that_cannot_train_here_are_refused_before_the_run(tmp_path, override, named):
    from relax.services.run_context import RunContext

    cfg = tiny_config(f"file://{tmp_path}", "refused", "model.family=qwen3_moe", "trainer.backend=megatron",
                      "rollout.prompts_per_step=3", *override.split())
    with pytest.raises(ConfigError, match=named):
        check_trainable(RunContext(cfg))
