"""The policy's media encoders as the trainers see them: found by module name, frozen, thawed on schedule."""

from __future__ import annotations

import pytest
from tiny import tiny_qwen2

from relax.config import load_config
from relax.models import build_policy, build_tokenizer
from relax.trainers.torch.encoders import EncoderSchedule, encoder_parameters, freeze_encoders


@pytest.fixture(scope="module")
def omni():
    cfg = load_config("omni-cpu")
    return build_policy(cfg.model, build_tokenizer(cfg.model.tokenizer), seed=0)[0]


def test_freezing_an_encoder_the_model_lacks_names_it():
    with pytest.raises(ValueError, match="no vision encoder"):
        freeze_encoders(tiny_qwen2(), ["vision"])
    with pytest.raises(ValueError, match="unknown encoder 'video'"):
        freeze_encoders(tiny_qwen2(), ["video"])


def test_encoder_parameters_are_the_towers_by_whole_module_name(omni):
    for kind, module in (("vision", "visual"), ("audio", "audio_tower")):
        found = {id(p) for p in encoder_parameters(omni, kind)}
        assert found == {id(p) for n, p in omni.named_parameters() if module in n.split(".")} and found
    assert encoder_parameters(tiny_qwen2(), "audio") == []


def test_a_schedule_holds_the_tower_until_its_update_then_thaws_it_once(omni):
    t = load_config("omni-cpu", ["trainer.freeze_encoders=[vision]", "trainer.thaw_encoders_at=3",
                                 "trainer.thaw_warmup_steps=2"]).trainer
    schedule = EncoderSchedule(omni, t, updates=4)
    vision = encoder_parameters(omni, "vision")
    assert all(p.requires_grad for p in vision)  # the optimizer collects the tower ...
    schedule.hold(omni)
    assert not any(p.requires_grad for p in vision)  # ... then it is held
    # thawed towers: lr x encoder_lr_scale x thaw_lr_scale, ramped from RL step 3 (update 12) over 2 steps (8 updates)
    assert schedule.lr_scales == {"visual": t.encoder_lr_scale * t.thaw_lr_scale, "audio_tower": t.encoder_lr_scale}
    assert schedule.ramps == {"visual": (12, 8)}
    assert schedule.thaw_if_due(omni, 11) == [] and not any(p.requires_grad for p in vision)
    assert schedule.thaw_if_due(omni, 12) == ["vision"] and all(p.requires_grad for p in vision)
    assert schedule.thaw_if_due(omni, 13) == []


def test_without_a_thaw_the_towers_stay_out_of_the_optimizer_for_good(omni):
    t = load_config("omni-cpu", ["trainer.freeze_encoders=[audio]", "trainer.thaw_encoders_at=0"]).trainer
    schedule = EncoderSchedule(omni, t, updates=4)
    assert not any(p.requires_grad for p in encoder_parameters(omni, "audio"))
    assert not schedule.ramps and schedule.thaw_if_due(omni, 10**9) == []
