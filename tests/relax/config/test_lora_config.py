"""model.lora: its fields and every refusal, each naming the field and the fix."""

from __future__ import annotations

import pytest

from relax.config import ConfigError, load_config
from relax.config.model import LORA_MODULES, lora_targets


def test_lora_is_off_by_default_and_targets_the_family_default():
    cfg = load_config(None, [])
    assert cfg.model.lora.rank == 0
    cfg = load_config(None, ["model.lora.rank=8"])
    assert lora_targets(cfg.model) == list(LORA_MODULES["qwen2"])
    cfg = load_config(None, ["model.lora.rank=8", "model.lora.target_modules=[q_proj,v_proj]"])
    assert lora_targets(cfg.model) == ["q_proj", "v_proj"]


def test_megatron_backend_is_refused_before_the_run():
    with pytest.raises(ConfigError, match=r"model.lora .*set trainer.backend=torch"):
        load_config(None, ["model.lora.rank=8", "trainer.backend=megatron"])


def test_moe_experts_are_refused_naming_the_module():
    with pytest.raises(ConfigError, match=r"model.lora.target_modules names 'experts'.*mlp.experts"):
        load_config(None, ["model.lora.rank=4", "model.family=qwen3_moe", "model.lora.target_modules=[experts]"])
    # qwen3_moe has no dense MLP: its projections are the experts'
    with pytest.raises(ConfigError, match=r"'gate_proj', which model.family=qwen3_moe has no projection"):
        load_config(None, ["model.lora.rank=4", "model.family=qwen3_moe", "model.lora.target_modules=[gate_proj]"])
    # qwen2_moe's gate/up/down are its shared expert's nn.Linear layers
    cfg = load_config(None, ["model.lora.rank=4", "model.family=qwen2_moe", "model.lora.target_modules=[gate_proj]"])
    assert lora_targets(cfg.model) == ["gate_proj"]


def test_settings_that_would_ignore_the_adapter_are_refused():
    with pytest.raises(ConfigError, match="rollout.weight_sync=disk"):
        load_config(None, ["model.lora.rank=8", "rollout.weight_sync=broadcast"])
    with pytest.raises(ConfigError, match="set model.lora.rank"):
        load_config(None, ["model.lora.init_checkpoint=/tmp/x"])


def test_thawing_encoders_is_refused_since_no_version_would_carry_them():
    with pytest.raises(ConfigError, match=r"trainer.thaw_encoders_at=500 would train encoder weights that no weight "
                                          r"version or checkpoint carries: set trainer.thaw_encoders_at=0"):
        load_config("omni-cpu", ["model.lora.rank=8"])  # the preset thaws its vision tower at step 500
    # frozen for the whole run (no thaw, or one at or past total_steps): the encoders stay as the base has them
    assert load_config("omni-cpu", ["model.lora.rank=8", "trainer.thaw_encoders_at=0"]).model.lora.rank == 8
    assert load_config("omni-cpu", ["model.lora.rank=8", "trainer.thaw_encoders_at=1200"]).model.lora.rank == 8


def test_data_parallel_and_the_prefix_layout_are_accepted():
    cfg = load_config(None, ["model.lora.rank=8", "trainer.data_parallel=2", "trainer.micro_batch_layout=prefix",
                             "algorithm.kl_coef=0.1"])
    assert (cfg.trainer.data_parallel, cfg.trainer.micro_batch_layout) == (2, "prefix")
