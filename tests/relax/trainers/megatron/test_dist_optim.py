"""The distributed optimizer's refusals and the CPU stand-in for megatron's CUDA calls (in this process: no
process group is needed for either). Its steps are tested on two ranks in test_actor_distopt_cpu.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

from relax.trainers.megatron.cpu import megatron_calls_on_cpu  # noqa: E402
from relax.trainers.megatron.dist_optim import DistributedAdam  # noqa: E402


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in is a no-op where CUDA exists")
def test_megatrons_cuda_calls_land_on_the_cpu_inside_the_block_only() -> None:
    with megatron_calls_on_cpu():
        t = torch.zeros(3, device="cuda")  # what megatron's optimizer allocates
        assert t.device.type == "cpu"
        assert torch.tensor([1.0], device=torch.cuda.current_device()).device.type == "cpu"
        assert t.cuda() is t
        assert t.type() == "torch.cuda.FloatTensor"  # megatron's accepted-parameter check
        assert t.bfloat16().type() == "torch.cuda.BFloat16Tensor"
        assert t.long().type() == "torch.LongTensor"  # only the float types it checks
        assert t.type(torch.float64).dtype == torch.float64  # a conversion is still a conversion
    assert t.type() == "torch.FloatTensor"
    with pytest.raises((AssertionError, RuntimeError)):
        torch.zeros(3, device="cuda")


def test_one_learning_rate_and_float32_weights_or_a_named_refusal() -> None:
    a, b = torch.nn.Parameter(torch.zeros(3, 3)), torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(
        ValueError, match="one learning rate; per-module lr scales .*trainer.distributed_optimizer=false"
    ):
        DistributedAdam([{"params": [a], "lr": 1e-3}, {"params": [b], "lr": 2e-3}], lr=1e-3, policy=None)
    half = torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="steps float32 weights .* build the model in float32"):
        DistributedAdam([{"params": [a, half]}], lr=1e-3, policy=None)
