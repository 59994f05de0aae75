"""One actor step of the Megatron backend at tensor parallel 2 (two gloo ranks on CPU) equals the
PyTorch backend's: the same loss, gradient norm (summed over the shards: a norm over one rank's
shards would be smaller) and updated weights (gathered back into the Hugging Face layout).

Each rank is a child process (this file as a script; megatron keeps process-wide state) that
first takes the PyTorch step on a copy of the same tiny Qwen2, then joins the process group and
takes the Megatron step at tp=2, and writes what it measured as JSON.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.relax.trainers.megatron.child_ranks import run_ranks

pytest.importorskip(
    "megatron.core",
    reason="megatron-core does not import; pip install --no-deps megatron-core==0.16.1",
    exc_type=ImportError,
)

HERE = Path(__file__).resolve()

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = tmp_path_factory.mktemp("mcore-tp2")
    run_ranks(HERE, 2, str(out), what="tp=2")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_a_tp2_actor_step_equals_the_pytorch_backend(ranks: list[dict[str, Any]], family: str) -> None:
    # qwen3's per-head q/k norms see only this rank's heads: their gradients are summed over the TP ranks
    for res in (r[family] for r in ranks):
        assert res["tp"] == 2 and res["dp"] == 1
        assert res["loss_megatron"] == pytest.approx(res["loss_torch"], abs=1e-5)
        assert res["grad_norm_megatron"] == pytest.approx(res["grad_norm_torch"], rel=1e-5)
        assert res["grad_norm_torch"] > 1.0  # above trainer.grad_clip=1: the clipped update is what is compared
        assert res["max_weight_diff"] < 1e-5 and res["max_weight_change"] > 1e-4
    # each rank held half of the sharded weights, and the norm of one half alone is smaller
    assert all(r[family]["local_shard_norm"] < r[family]["grad_norm_torch"] for r in ranks)


def _main(rank: int, port: str, out: str) -> None:  # out: this rank's JSON file
    import copy

    import torch
    from tiny import VOCAB, tiny_batch, tiny_qwen2
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from relax.config import load_config
    from relax.trainers.torch.actor import Actor

    cfg = load_config(None, ["trainer.warmup_steps=0", "trainer.lr=1e-3", "rollout.max_new_tokens=16",
                             "algorithm.off_policy=none", "trainer.micro_batch_layout=pack",
                             "trainer.micro_batch_tokens=40", "trainer.grad_clip=1.0"])
    torch.manual_seed(0)
    models = {"qwen2": tiny_qwen2(), "qwen3": Qwen3ForCausalLM(Qwen3Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512))}
    steps = {}
    for family, hf in models.items():  # before any process group: the plain PyTorch step
        batch = tiny_batch()
        torch_actor = Actor(copy.deepcopy(hf), cfg)
        batch.old_logprobs = [lp - 0.05 * m for lp, m in zip(torch_actor.logprobs(batch), batch.loss_mask,
                                                             strict=True)]
        steps[family] = (batch, torch_actor.train_step(batch), torch_actor.model.state_dict())

    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate

    from relax.trainers.megatron.cpu import init_cpu_distributed, shutdown_distributed
    from relax.trainers.megatron.policy import megatron_policy

    init_cpu_distributed(rank, 2, int(port), tp=2)
    result = {}
    for family, hf in models.items():
        batch, a, after_t = steps[family]
        mcore_actor = Actor(megatron_policy(copy.deepcopy(hf)), cfg)
        b = mcore_actor.train_step(batch)
        # the pre-clip norm of this rank's shards alone, from the gradients the clip scaled by min(1, 1/norm)
        scale = min(1.0, 1.0 / (b.grad_norm + 1e-6))
        local = sum(float(p.grad.double().pow(2).sum()) for p in mcore_actor.model.parameters()
                    if p.grad is not None and param_is_not_tensor_parallel_duplicate(p)) ** 0.5 / scale
        after_m = mcore_actor.model.state_dict()  # the export gathers shards
        result[family] = {
            "tp": parallel_state.get_tensor_model_parallel_world_size(),
            "dp": parallel_state.get_data_parallel_world_size(),
            "loss_torch": a.loss, "loss_megatron": b.loss, "grad_norm_torch": a.grad_norm,
            "grad_norm_megatron": b.grad_norm, "local_shard_norm": local,
            "max_weight_diff": max(float((after_t[k] - after_m[k]).abs().max()) for k in after_m),
            "max_weight_change": max(float((after_t[k] - hf.state_dict()[k]).abs().max()) for k in after_m)}
    Path(out).write_text(json.dumps(result))
    shutdown_distributed()  # a gloo group left to the interpreter's exit can abort it


if __name__ == "__main__":
    _main(int(sys.argv[1]), sys.argv[3], str(Path(sys.argv[4]) / f"{sys.argv[1]}.json"))
