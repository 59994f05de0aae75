"""The optimizer's parameter groups and LR schedule, including the media encoders' LR multiplier."""

from __future__ import annotations

import math

import pytest
import torch

from relax.trainers.torch.optim import build_optimizer, lr_factor


class _Omni(torch.nn.Module):
    """A decoder layer beside a 'visual' encoder: the module names the multiplier matches on."""

    def __init__(self):
        super().__init__()
        self.visual = torch.nn.Linear(3, 3)  # weight (decayed) and bias (not)
        self.lm = torch.nn.Linear(3, 3)


def _lrs(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, float]:
    group_of = {id(p): g for g in optimizer.param_groups for p in g["params"]}
    return {name: group_of[id(p)]["lr"] for name, p in model.named_parameters()}


def test_encoder_parameters_get_the_scaled_lr_and_the_schedule_scales_every_group():
    model = _Omni()
    optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.1, warmup_steps=2, total_steps=10,
                                           lr_scales={"visual": 3.0})
    # warm-up step 0: factor (0 + 1) / 2 = 0.5, so the LM's lr is 1e-3 * 0.5 = 5e-4 and the
    # encoder's 3 * 1e-3 * 0.5 = 1.5e-3
    assert _lrs(optimizer, model) == pytest.approx({"visual.weight": 1.5e-3, "visual.bias": 1.5e-3,
                                                    "lm.weight": 5e-4, "lm.bias": 5e-4})
    decay = {id(p): g["weight_decay"] for g in optimizer.param_groups for p in g["params"]}
    assert decay[id(model.visual.weight)] == 0.1 and decay[id(model.visual.bias)] == 0.0  # biases never decay
    optimizer.step()  # no gradients yet: moves nothing, but keeps the scheduler's call order
    scheduler.step()  # step 1: factor 2 / 2 = 1
    assert _lrs(optimizer, model)["visual.weight"] == pytest.approx(3e-3)


def test_without_scales_the_two_group_layout_of_saved_checkpoints_is_kept():
    # a checkpoint's optimizer state lists its groups in order: [decayed, not decayed]
    optimizer, _ = build_optimizer(_Omni(), lr=1e-3, weight_decay=0.1, warmup_steps=0, total_steps=10)
    assert [(len(g["params"]), g["weight_decay"]) for g in optimizer.param_groups] == [(2, 0.1), (2, 0.0)]
    scaled_to_one, _ = build_optimizer(_Omni(), lr=1e-3, weight_decay=0.1, warmup_steps=0, total_steps=10,
                                       lr_scales={"visual": 1.0})
    assert len(scaled_to_one.param_groups) == 2


def test_cosine_factor_by_hand():
    # no warm-up, 10 steps: step 5 is half way, 0.1 + 0.9 * 0.5 * (1 + cos(pi / 2)) = 0.55;
    # step 10 and later sit at the floor 0.1
    assert lr_factor(0, 0, 10, "cosine") == pytest.approx(1.0)
    assert lr_factor(5, 0, 10, "cosine") == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi / 2)))
    assert lr_factor(12, 0, 10, "cosine") == pytest.approx(0.1)


def test_a_ramped_encoder_warms_up_from_its_thaw_step_while_the_rest_follows_the_schedule():
    model = _Omni()
    optimizer, scheduler = build_optimizer(model, lr=1e-3, weight_decay=0.1, warmup_steps=0, total_steps=100,
                                           lr_scales={"visual": 0.5}, ramps={"visual": (2, 4)})
    seen = []
    for _ in range(7):
        lrs = _lrs(optimizer, model)
        seen.append((lrs["visual.weight"], lrs["visual.bias"], lrs["lm.weight"]))
        optimizer.step()
        scheduler.step()
    # constant schedule: the LM at 1e-3 throughout;
    # the encoder at 0.5e-3 x clamp((step - 2 + 1) / 4, 0, 1): steps 0-1 -> 0, 2 -> 1/4, 3 -> 2/4,
    # 4 -> 3/4, 5 and on -> 1
    ramp = [0, 0, 1.25e-4, 2.5e-4, 3.75e-4, 5e-4, 5e-4]
    assert [w for w, _, _ in seen] == pytest.approx(ramp)
    assert [b for _, b, _ in seen] == pytest.approx(ramp)  # the bias ramps too
    assert [lm for _, _, lm in seen] == pytest.approx([1e-3] * 7)
    # one group per (scale, decay, ramp): LM decayed, LM not, encoder decayed, encoder not
    assert len(optimizer.param_groups) == 4
