"""The trainer section's checks: layouts the backend would not honour, thawing on one rank."""

from __future__ import annotations

import pytest

from relax.config import (
    ConfigError,
    load_config,
)


def test_thawing_needs_one_rank():
    with pytest.raises(ConfigError, match="data_parallel=1"):
        load_config("omni-cpu", ["trainer.thaw_encoders_at=10", "trainer.data_parallel=2"])
    assert load_config("omni-cpu", ["trainer.thaw_encoders_at=10"]).trainer.thaw_encoders_at == 10


def test_backend_layouts_are_honoured_or_refused():
    # a parallel layout the chosen backend would ignore is an error naming the field, not a quiet no-op
    with pytest.raises(ConfigError, match="trainer.tensor_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.tensor_parallel=2"])
    assert load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2"]).trainer.context_parallel == 2
    assert load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2",
                              "trainer.pipeline_parallel=2"]).trainer.pipeline_parallel == 2
    with pytest.raises(ConfigError, match="trainer.context_parallel=2 with expert_parallel=2: .* set one of them to 1"):
        load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2", "trainer.expert_parallel=2",
                           "trainer.data_parallel=2"])
    with pytest.raises(ConfigError, match="trainer.context_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.context_parallel=2"])
    # expert parallel splits the experts over data-parallel ranks: it must divide them, and runs at pp = 1
    with pytest.raises(
        ConfigError, match="expert_parallel=2 splits the experts .* must divide trainer.data_parallel=1"
    ):
        load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2"])
    with pytest.raises(ConfigError, match="expert_parallel=2 with pipeline_parallel=2: .* use pipeline_parallel=1"):
        load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2", "trainer.data_parallel=2",
                           "trainer.pipeline_parallel=2"])
    with pytest.raises(ConfigError, match="trainer.expert_parallel=2 is a Megatron layout"):
        load_config(None, ["trainer.expert_parallel=2", "trainer.data_parallel=2"])
    # megatron's DistributedOptimizer is the Megatron backend's; the torch backend would step plain AdamW
    with pytest.raises(ConfigError, match="trainer.distributed_optimizer=true is megatron-core's optimizer; the torch "
                                          "backend would ignore it: set trainer.backend=megatron"):
        load_config(None, ["trainer.distributed_optimizer=true", "trainer.data_parallel=2"])
    assert load_config(
        None, ["trainer.backend=megatron", "trainer.distributed_optimizer=true"]
    ).trainer.distributed_optimizer
    # sharded checkpoints are megatron's model-parallel parts; the torch backend's ranks hold whole replicas
    with pytest.raises(ConfigError, match="trainer.checkpoint_format=sharded writes megatron's model-parallel parts; "
                                          "the torch backend.* set trainer.checkpoint_format=gathered"):
        load_config(None, ["trainer.checkpoint_format=sharded"])
    assert load_config(
        None, ["trainer.backend=megatron", "trainer.checkpoint_format=sharded"]
    ).trainer.checkpoint_format
    ep = load_config(None, ["trainer.backend=megatron", "trainer.expert_parallel=2", "trainer.data_parallel=4"])
    assert (ep.trainer.expert_parallel, ep.trainer.data_parallel) == (2, 4)
    # data and tensor parallel ranks are the actor's processes (relax.services.roles.actor_ranks)
    cfg = load_config(None, ["trainer.backend=megatron", "trainer.tensor_parallel=2", "trainer.data_parallel=2"])
    assert (cfg.trainer.tensor_parallel, cfg.trainer.data_parallel) == (2, 2)
    assert load_config(None, ["trainer.data_parallel=2"]).trainer.data_parallel == 2
    with pytest.raises(ConfigError, match="a 2-rank actor .* colocated topology would share its process group"):
        load_config(None, ["trainer.data_parallel=2", "algorithm.advantage=gae", "model.value_head=true"])
    with pytest.raises(ConfigError, match="a 2-rank actor .* colocated topology would share its process group"):
        load_config(None, ["trainer.backend=megatron", "trainer.context_parallel=2", "algorithm.advantage=gae",
                           "model.value_head=true"])  # context ranks are processes too
    with pytest.raises(ConfigError, match="trainer.data_parallel=8 ranks but each optimizer step trains 4 samples"):
        load_config(None, ["trainer.data_parallel=8", "rollout.prompts_per_step=2", "rollout.n_samples_per_prompt=4",
                           "trainer.mini_batches=2"])
    with pytest.raises(ConfigError, match="micro_batch_layout=prefix"):
        load_config(None, ["trainer.backend=megatron", "trainer.micro_batch_layout=prefix"])
    with pytest.raises(ConfigError, match="not model.family='qwen2_audio'"):
        load_config(None, ["trainer.backend=megatron", "model.family=qwen2_audio"])
    assert load_config(None, ["trainer.backend=megatron"]).trainer.backend == "megatron"
