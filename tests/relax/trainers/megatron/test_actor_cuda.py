"""The Megatron actor on a CUDA GPU (one rank, NCCL), with AdamW and with megatron's DistributedOptimizer
(``trainer.distributed_optimizer``): one step equals the PyTorch backend's on the same GPU in float32 (TF32
off), and a bf16-autocast step is finite and moves every tensor. Runs where a GPU is
(``make test-gpu``, benchmarks/gpu_check.py); one child process, as megatron keeps process-wide state."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.relax.trainers.megatron.child_ranks import run_child

HERE = Path(__file__).resolve()

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(scope="module")
def child(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    pytest.importorskip("megatron.core", exc_type=ImportError)
    return run_child(HERE, tmp_path_factory.mktemp("mcore-cuda") / "cuda.json")


OPTIMIZERS = ("AdamW", "DistributedAdam")


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_megatron_actor_step_on_cuda_equals_the_pytorch_backend(child: dict[str, Any], optimizer: str) -> None:
    res = child[f"float32 {optimizer}"]
    assert res["optimizer"] == optimizer
    assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
    assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-4)
    assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_bf16_megatron_actor_step_on_cuda_trains(child: dict[str, Any], optimizer: str) -> None:
    res = child[f"bfloat16 {optimizer}"]
    assert res["optimizer"] == optimizer
    assert res["finite"] and res["grad_norm_megatron"] > 0
    assert res["moved"] == res["tensors"]  # float32 master weights: every tensor takes the update
    assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=2e-2)  # bf16 rounding, same step


def _main(out: str) -> None:
    import copy

    from tiny import tiny_batch, tiny_qwen2

    from relax.config import load_config
    from relax.trainers.megatron.policy import megatron_policy
    from relax.trainers.torch.actor import Actor

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    result: dict[str, Any] = {}
    hf = tiny_qwen2().cuda()
    batch = tiny_batch()
    batch.input_ids = [t.cuda() for t in batch.input_ids]
    batch.loss_mask = [m.cuda() for m in batch.loss_mask]
    batch.old_logprobs = [o.cuda() for o in batch.old_logprobs]
    batch.advantages = [a.cuda() for a in batch.advantages]
    for dtype, distributed in [(d, o) for o in (False, True) for d in ("float32", "bfloat16")]:
        cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                                 "algorithm.off_policy=none", "trainer.micro_batch_tokens=40", f"model.dtype={dtype}"])
        torch_actor = Actor(copy.deepcopy(hf), cfg)
        mcore_actor = Actor(megatron_policy(copy.deepcopy(hf), distributed_optimizer=distributed), cfg)
        a, b = torch_actor.train_step(batch), mcore_actor.train_step(batch)
        after_t, after_m, before = torch_actor.model.state_dict(), mcore_actor.model.state_dict(), hf.state_dict()
        optimizer = type(mcore_actor.trainer.optimizer).__name__
        result[f"{dtype} {optimizer}"] = {
            "optimizer": optimizer,
            "loss_torch": a.loss,
            "loss_megatron": b.loss,
            "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm,
            "finite": not b.skipped,
            "tensors": len(after_m),
            "moved": sum(not torch.equal(after_m[k], before[k]) for k in after_m),
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            "max_weight_change": max(float((after_m[k] - before[k]).abs().max()) for k in after_m),
        }
    Path(out).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1])
